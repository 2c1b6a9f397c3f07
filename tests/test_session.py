"""What a client session receives (control/session.py), and its conversion at the service edge
(control/wire.py): a request's output is copied when published, and goes out as the protocol's
messages field for field."""
from __future__ import annotations

from ttserve.control.request import FinishReason, Request, SamplingParams, TokenLogprobs
from ttserve.control.session import Admission, StepOutputs, Verdict, output_of
from ttserve.control.wire import output_to_pb, session_message_to_pb
from ttserve.v1 import engine_pb2


def running(logprobs: int | None = None) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, logprobs=logprobs))
    r.placed(1, 2)
    r.num_cached_tokens = 2
    return r


def test_an_output_is_a_copy_the_request_moving_on_does_not_change():
    r = running(logprobs=1)
    r.output_token_ids += [7, 8]
    r.unsent_logprobs += [TokenLogprobs([7, 3], [-0.5, -1.0], 1), TokenLogprobs([8, 3], [-0.1, -2.0], 1)]
    out = output_of(r)
    r.mark_sent()
    r.output_token_ids.append(9)
    r.unsent_logprobs.append(TokenLogprobs([9], [-0.2], 1))
    assert out.new_token_ids == [7, 8] and [lp.token_ids for lp in out.logprobs] == [[7, 3], [8, 3]]
    assert output_of(r).new_token_ids == [9]


def test_the_cached_tokens_ride_on_the_first_output_only():
    r = running()
    r.output_token_ids.append(7)
    first = output_of(r)
    r.mark_sent()
    r.output_token_ids.append(8)
    assert first.num_cached_tokens == 2 and output_of(r).num_cached_tokens == 0


def test_a_step_goes_out_as_the_protocol_says():
    r = running(logprobs=1)
    r.output_token_ids.append(7)
    r.unsent_logprobs.append(TokenLogprobs([7, 3], [-0.5, -1.0], 2))
    r.finish(FinishReason.STOP, stop_token_id=7)
    message = session_message_to_pb(StepOutputs(5, 1234.5, (output_of(r),)))
    expected = engine_pb2.ServerMessage(outputs=engine_pb2.StepOutputs(step_id=5, timestamp=1234.5, outputs=[
        engine_pb2.RequestOutput(request_id="r", new_token_ids=[7], finish_reason=engine_pb2.FINISH_REASON_STOP,
                                 stop_token_id=7, num_cached_tokens=2, worker=1, lane=2, logprobs=[
                                     engine_pb2.TokenLogprobs(token_ids=[7, 3], logprobs=[-0.5, -1.0], rank=2)])]))
    assert message.SerializeToString() == expected.SerializeToString()


def test_an_error_goes_out_as_the_client_may_read_it():
    r = running()
    r.finish(FinishReason.ERROR, "worker at 10.0.0.1:50061 failed", invalid=True)
    out = output_to_pb(output_of(r, error="worker w0 failed"))
    assert (out.error, out.invalid_request, out.finish_reason) == ("worker w0 failed", True,
                                                                   engine_pb2.FINISH_REASON_ERROR)


def test_each_verdict_has_its_protocol_value():
    for verdict, value in ((Verdict.ACCEPTED, engine_pb2.Admission.VERDICT_ACCEPTED),
                           (Verdict.INVALID_ARGUMENT, engine_pb2.Admission.VERDICT_INVALID_ARGUMENT),
                           (Verdict.UNAVAILABLE, engine_pb2.Admission.VERDICT_UNAVAILABLE),
                           (Verdict.OVERLOADED, engine_pb2.Admission.VERDICT_OVERLOADED)):
        message = session_message_to_pb(Admission("r", verdict, "why"))
        assert message.SerializeToString() == engine_pb2.ServerMessage(admission=engine_pb2.Admission(
            request_id="r", verdict=value, message="why")).SerializeToString()
