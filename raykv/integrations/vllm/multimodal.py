"""A vLLM request's multimodal inputs as raykv :class:`~raykv.core.keys.MultimodalItem` s, so
that the blocks an image (audio, video...) covers are keyed by its content, not by the
placeholder token ids every image of the same size shares.

Contract of :func:`mm_items` (vLLM 0.32's ``Request.mm_features``, one ``MultiModalFeatureSpec``
per item; duck-typed, nothing from vLLM is imported):

- positions: the feature's ``mm_position`` ``PlaceholderRange(offset, length)``; the item is
  ``MultimodalItem(digest, start=offset, length=length)``. The whole range is the item, positions
  whose ``is_embed`` is False included (the processor put those tokens there for this item).
- digest: ``SHA-256(MM_FEATURE_DOMAIN || u32(len(m)) || m || u32(len(i)) || i)`` with ``m`` the
  feature's ``modality`` and ``i`` its ``identifier`` (UTF-8; u32 little-endian lengths, so no
  two (modality, identifier) pairs share a preimage; the domain keeps these digests apart from
  :meth:`MultimodalItem.from_content`'s).
- what the identifier covers (vLLM 0.32, ``multimodal/processing/inputs.py`` and
  ``v1/engine/input_processor.py``): vLLM's mm hash, ``MultiModalHasher.hash_kwargs`` (blake3 by
  default, ``mm_hasher_algorithm``) over the model id, the item's content under its modality and
  the modality's ``media_io_kwargs`` / ``mm_processor_kwargs``, which change the processor's
  output; when the client names the item (``multi_modal_uuids``) and the request has no such
  kwargs, the client's uuid verbatim: then the uuid must name the content, as vLLM's own prefix
  and encoder caches assume. With ``enable_tower_connector_lora`` it is prefixed with the LoRA's
  name (the embeddings depend on the adapter). The modality is hashed as well because a client
  uuid does not carry it. The LoRA adapter and ``cache_salt`` key the request's
  :class:`~raykv.ReuseScope`, not the digest.

A request without features (a text-only one, or an object without ``mm_features``) gives ``()``,
so its keys are the text keys.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Final

from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import MultimodalItem

MM_FEATURE_DOMAIN: Final = b"raykv-vllm-mm-feature-v1\x00"


def feature_digest(modality: str, identifier: str) -> bytes:
    """The 32-byte digest of a feature of ``modality`` whose vLLM identifier is ``identifier``."""
    sha = hashlib.sha256(MM_FEATURE_DOMAIN)
    for part in (modality.encode("utf-8"), identifier.encode("utf-8")):
        sha.update(len(part).to_bytes(4, "little"))
        sha.update(part)
    return sha.digest()


def mm_items(request: Any, num_tokens: int) -> tuple[MultimodalItem, ...]:
    """The multimodal items of vLLM ``request`` (see the module docstring), sorted by start.

    Raises InvalidArgumentError for a feature without a str identifier, a placeholder range that
    is empty, negative or reaches past ``num_tokens`` (the prompt's length), or two features
    whose ranges overlap.
    """
    features = getattr(request, "mm_features", None) or ()
    spans = []
    for index, feature in enumerate(features):
        identifier = getattr(feature, "identifier", None)
        modality = getattr(feature, "modality", None) or ""
        if not isinstance(identifier, str) or not identifier or not isinstance(modality, str):
            raise InvalidArgumentError(
                "mm_features", f"feature {index} has no str identifier/modality: {identifier!r}"
            )
        position = feature.mm_position
        start, length = int(position.offset), int(position.length)
        if start < 0 or length < 1 or start + length > num_tokens:
            raise InvalidArgumentError(
                "mm_features",
                f"feature {index} ({modality} {identifier[:16]!r}) covers tokens "
                f"{start}..{start + length} outside the prompt's {num_tokens} tokens",
            )
        spans.append((start, length, index, feature_digest(modality, identifier)))
    spans.sort()
    for (start_a, length_a, a, _), (start_b, _, b, _) in itertools.pairwise(spans):
        if start_b < start_a + length_a:
            raise InvalidArgumentError(
                "mm_features",
                f"features {a} and {b} overlap (tokens {start_a}..{start_a + length_a} and from {start_b})",
            )
    return tuple(MultimodalItem(digest, start, length) for start, length, _, digest in spans)
