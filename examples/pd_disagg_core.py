"""Disaggregated prefill/decode with the pure core: two managers, a page server, a client.

A prefill manager computes (here: the content oracle writes) and commits a prompt's KV. A decode
manager pulls exactly those committed blocks over the transfer layer, once through the same-node
shared-memory path and once over UCX, imports them, and continues the request: its create()
reuses every pulled block, and every byte is verified. A pull with a wrong token is refused.
Run: python examples/pd_disagg_core.py (needs ucxx; everything binds 127.0.0.1)
"""

from __future__ import annotations

import raykv
from raykv.transfer import AuthToken, PageClient, PageServer, TransferConfig, get_runtime, pull_into


def manager(layout: raykv.KVLayout, shared: bool) -> raykv.CacheManager:
    host = raykv.TierConfig.host(64 * layout.page_bytes, pin_memory=False, shared=shared)
    return raykv.CacheManager(raykv.CacheConfig(layout, (host,)))


def main() -> None:
    layout = raykv.KVLayout.uniform(num_layers=4, num_kv_heads=2, head_dim=16, tokens_per_block=8)
    oracle = raykv.ContentOracle(layout)
    config = TransferConfig.loopback()
    token = AuthToken.generate()  # the deployment-wide secret; never printed
    prompt = list(range(1000, 1064))  # 8 full blocks
    with manager(layout, shared=True) as prefill, manager(layout, shared=False) as decode:
        with prefill.create(prompt) as cache:  # prefill: compute and commit
            assert cache.resume()
            cache.extend(prompt)
            oracle.fill_cache(cache)
            assert cache.commit() == 8
            keys = [cache.block_key(i) for i in range(8)]
        server = PageServer(prefill, token, config)
        address = server.start()
        client = PageClient(token, config)
        try:
            for prefer_shm in (True, False):
                outcome = get_runtime().run(pull_into(client, address, decode, keys, prefer_shm), 60)
                assert outcome.complete, outcome
                print(f"pulled {len(keys)} blocks via {outcome.path}: {len(outcome.imported)} new")
            with decode.create([*prompt, 1, 2, 3]) as cache:  # decode: reuse, then continue
                assert cache.num_reused_tokens == len(prompt)
                assert cache.resume()
                oracle.verify_cache(cache)
                cache.extend([4, 5])
            assert oracle.verify_manager(decode) == 8
            intruder = PageClient(AuthToken.generate(), config)
            try:
                intruder.pull_sync(address, keys)
                raise AssertionError("a peer without the token was served")
            except raykv.TransferError as exc:
                assert exc.reason == "auth"
            finally:
                intruder.close()
            print(f"paths used: {dict(client.stats.pulls)}; a wrong token was refused")
        finally:
            client.close()
            server.close()
        prefill.check_invariants()
        decode.check_invariants()
    print("OK")


if __name__ == "__main__":
    main()
