"""Token-level stop conditions, checked after every token the scheduler appends.

String stops (`SamplingParams.stop`) need text and live in the detokenizer, not here.
"""

from __future__ import annotations

from engine.sched.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it; True if it does.

    Order: a stop token (EOS unless `ignore_eos`, or one of `stop_token_ids`) wins over the
    length limits when both apply to the same token, and neither stop kind fires before
    `min_tokens` outputs. Length: `max_tokens` outputs, or `max_model_len` tokens in all.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and request.eos_token_id is not None \
                and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
