"""What an offer must be for a node to take it, whatever the gateway sending it: an offer
past these fails an engine step (every request of its batch), a CUDA device assert (every
step after it), or the node itself (a KV transfer asked to skip a part of a block)."""

from __future__ import annotations

from pdserve.common.prefix import token_ids_problem
from pdserve.common.wire.protocol import PrefillOffer


def offer_refusal(offer: PrefillOffer, max_model_len: int, vocab_size: int) -> str | None:
    """Why `offer` cannot be taken as it is (None: it can)."""
    n = len(offer.prompt_ids)
    if n == 0:
        return "an empty prompt"
    if n >= max_model_len:  # the rotary table has max_model_len rows: one more token at least
        return f"prompt has {n} tokens; the context limit is {max_model_len}"
    if (bad := token_ids_problem(offer.prompt_ids, vocab_size)) is not None:
        return bad
    if not 0 <= offer.prompt_len <= n:
        return f"prompt_len {offer.prompt_len} is not a length of its {n} tokens"
    if not 0 <= offer.decode_cached < n:
        return f"decode_cached {offer.decode_cached} is not a prefix of its {n} tokens"
    return None
