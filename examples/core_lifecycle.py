"""A request's life in one CacheManager, checked end to end.

Two requests share a prompt prefix. The first computes (here: the content oracle writes) KV and
commits it; tiers are tiny, so unrelated traffic then pushes those blocks down to disk. The second
request reuses the prefix: resume() promotes the blocks back to the top tier, and every byte is
verified. Finally the blocks are exported and imported into a second manager, as a peer would.
Run: python examples/core_lifecycle.py
"""

from __future__ import annotations

import raykv


def main() -> None:
    layout = raykv.KVLayout.uniform(num_layers=4, num_kv_heads=2, head_dim=16, tokens_per_block=8)
    page = layout.page_bytes
    config = raykv.CacheConfig(layout, (raykv.TierConfig.host(6 * page), raykv.TierConfig.disk(32 * page)))
    oracle = raykv.ContentOracle(layout)
    scope = raykv.ReuseScope.from_cache_salt("example-tenant")
    system = list(range(100, 132))  # 4 full blocks
    with raykv.CacheManager(config) as mgr:
        first = mgr.create([*system, 1, 2, 3], scope=scope, request_id=1)
        assert first.num_reused_tokens == 0 and first.resume()
        first.extend([*system, 1, 2, 3])
        oracle.fill_cache(first)
        assert first.commit() == 4
        first.close()
        for i in range(3):  # unrelated traffic demotes the system prompt to disk
            other = mgr.create(list(range(1000 * (i + 1), 1000 * (i + 1) + 40)))
            assert other.resume()
            other.extend(list(range(1000 * (i + 1), 1000 * (i + 1) + 40)))
            oracle.fill_cache(other)
            other.commit()
            other.close()
        probe = mgr.probe(system, scope=scope)
        assert probe.num_blocks == 4 and raykv.TierKind.DISK in probe.tiers, probe
        second = mgr.create([*system, 9, 9], scope=scope, request_id=2)
        assert second.num_reused_tokens == 32
        assert second.resume()  # promoted back to the top tier
        oracle.verify_cache(second)
        second.close()
        mgr.check_invariants()
        exported = mgr.export_blocks(raykv.block_keys(system, 8, scope))
        with raykv.CacheManager(config) as peer:
            result = peer.import_blocks(exported)
            assert len(result.imported) == 4
            assert peer.probe(system, scope=scope).num_blocks == 4
            assert oracle.verify_manager(peer) == 4
        print(mgr.stats().table())
    print("core_lifecycle: OK")


if __name__ == "__main__":
    main()
