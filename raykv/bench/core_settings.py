"""How much work each benchmark of the ``core`` suite does (:mod:`raykv.bench.core`,
:mod:`raykv.bench.core_io`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreSettings:
    """How much work each benchmark does. ``QUICK`` is for CI (< 20 s on 2 cores)."""

    key_repeats: int
    radix_sequences: int
    radix_repeats: int
    copy_repeats: int
    demote_repeats: int
    warmup: int
    prompt_tokens: int = 8192
    copy_batch: int = 64
    demote_pages: int = 128

    def __post_init__(self) -> None:
        for name in ("key_repeats", "radix_sequences", "radix_repeats", "copy_repeats", "demote_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.warmup < 0 or self.prompt_tokens < 64 or self.copy_batch < 1 or self.demote_pages < 1:
            raise ValueError("warmup >= 0, prompt_tokens >= 64, copy_batch and demote_pages >= 1")


QUICK = CoreSettings(
    key_repeats=41, radix_sequences=10, radix_repeats=21, copy_repeats=7, demote_repeats=7, warmup=1
)
FULL = CoreSettings(
    key_repeats=1001, radix_sequences=50, radix_repeats=201, copy_repeats=61, demote_repeats=41, warmup=3
)


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import part_of

    sys.exit(part_of("core"))
