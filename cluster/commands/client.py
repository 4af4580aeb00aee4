"""`specserve client`: call a running service and print text, route and acceptance.

Owns: building a ``GenerateRequest`` from flags, unary or streaming calls with bearer auth and
a deadline, and printing the result (with each token's log-probabilities when asked). Ignores: serving.
"""
from __future__ import annotations

import argparse
import os
import sys

_MODES = {"auto": 0, "speculative": 1, "plain": 2}


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="call a running specserve service")
    p.add_argument("prompt")
    p.add_argument("--addr", default="127.0.0.1:9000")
    p.add_argument("--app", default="specserve", help="Serve application name (metadata)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.add_argument("--mode", choices=tuple(_MODES), default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--segment", default="")
    p.add_argument("--draft-scope", default="", help="draft only from answers of requests with this scope "
                   "(e.g. a tenant id; a drafter that learns from traffic: suffix, portfolio)")
    p.add_argument("--prediction", default="", help="the output you expect, or most of it (e.g. the file "
                   "being edited): the speculative path drafts from it; the output is the same without it")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each output token's log-probability and its N most likely alternatives (0..20)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="print each prompt token's log-probability (after the first) and its N most likely "
                        "alternatives; with --max-tokens 0 the prompt is only scored")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="vLLM's: divides the logit of every token the prompt or output holds, in (0, 10] (unset: none)")
    p.add_argument("--min-p", type=float, default=0.0, help="cut tokens less likely than this times the most likely one")
    p.add_argument("--logit-bias", type=_logit_bias, default={}, metavar="ID:BIAS[,ID:BIAS...]",
                   help="add BIAS (in [-100, 100]) to token ID's logit, e.g. 42:-100,7:5")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop but --max-tokens before this many tokens")
    p.add_argument("--stop-token-ids", type=_token_ids, default=[], metavar="ID[,ID...]",
                   help="token ids that end the output like EOS")
    p.add_argument("--json-schema", default="", help="JSON Schema text (the output is constrained to it)")
    p.add_argument("--regex", default="", help="a pattern the whole output matches")
    p.add_argument("--grammar", default="", help="a Lark grammar (llguidance's dialect; @FILE reads it from FILE) "
                   "the output is constrained to")
    p.add_argument("--tokenize", action="store_true", help="print the token ids the prompt (with --chat: the "
                   "chat) would feed the model, and their count, instead of generating")
    p.add_argument("--token", default=os.environ.get("SPECSERVE_TOKEN"), help="bearer token")
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(func=run)


def _logit_bias(text: str) -> dict[int, float]:
    """``42:-100,7:5`` -> {42: -100.0, 7: 5.0} (the server checks the ranges)."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(k): float(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID:BIAS[,ID:BIAS...], got {text!r}") from None


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID[,ID...], got {text!r}") from None


def _text_or_file(text: str) -> str:
    if not text.startswith("@"):
        return text
    with open(text[1:], encoding="utf-8") as f:
        return f.read()


def build_request(args):
    from cluster.api import stubs

    pb2 = stubs.generation_pb2()
    req = pb2.GenerateRequest(max_tokens=args.max_tokens, temperature=args.temperature,
                              mode=_MODES[args.mode], segment=args.segment,
                              json_schema=args.json_schema, regex=args.regex, grammar=_text_or_file(args.grammar),
                              draft_scope=args.draft_scope,
                              prediction=args.prediction, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, logit_bias=args.logit_bias,
                              min_tokens=args.min_tokens, stop_token_ids=args.stop_token_ids, min_p=args.min_p)
    if args.repetition_penalty is not None:
        req.repetition_penalty = args.repetition_penalty
    if args.logprobs is not None:
        req.logprobs = args.logprobs
    if args.prompt_logprobs is not None:
        req.prompt_logprobs = args.prompt_logprobs
    if args.chat:
        req.messages.append(pb2.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    return req


def format_logprobs(logprobs) -> str:
    """One line per output token (``OutputLogprobs``): its bytes, log-probability, alternatives."""
    def tok(t) -> str:
        return repr(bytes(t.token).decode("utf-8", errors="replace"))

    return "\n".join(f"{tok(o.chosen):>16} {o.chosen.logprob:9.4f}"
                     + ("   " + "  ".join(f"{tok(a)} {a.logprob:.3f}" for a in o.top) if o.top else "")
                     for o in logprobs)


def _tokenize(stub, pb2, args: argparse.Namespace, md: list) -> int:
    """``--tokenize``: the ids on stdout, one line; their count and the limits on stderr."""
    import grpc

    req = (pb2.TokenizeRequest(messages=[pb2.ChatMessage(role="user", content=args.prompt)]) if args.chat
           else pb2.TokenizeRequest(prompt=args.prompt))
    try:
        r = stub.Tokenize(req, metadata=md, timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"specserve client: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(" ".join(map(str, r.token_ids)))
    print(f"[tokens={r.count} max_model_len={r.max_model_len} max_prompt_tokens={r.max_prompt_tokens}]",
          file=sys.stderr)
    return 0


def _path_name(path: int) -> str:
    return {1: "speculative", 2: "plain"}.get(path, "unspecified")


def run(args: argparse.Namespace) -> int:
    import grpc

    from cluster.api import stubs
    from cluster.api.server_fields import UnsupportedField, check_request_fields

    md = [("application", args.app)] + ([("authorization", f"Bearer {args.token}")] if args.token else [])
    pb2 = stubs.generation_pb2()
    with grpc.insecure_channel(args.addr) as channel:
        stub = stubs.generation_grpc().GenerationStub(channel)
        if args.tokenize:
            return _tokenize(stub, pb2, args, md)
        try:
            request = build_request(args)
            # a field the server would ignore (an older server, a newer field) is not sent at all
            check_request_fields(request, stub.ModelInfo(pb2.ModelInfoRequest(), metadata=md, timeout=args.timeout))
            if args.stream:
                last = route = None
                logprobs, prompt_logprobs = [], []
                for ch in stub.GenerateStream(request, metadata=md, timeout=args.timeout):
                    if route is None and ch.HasField("route"):
                        route = ch.route
                    print(ch.text_delta, end="", flush=True)
                    logprobs += ch.logprobs
                    prompt_logprobs += ch.prompt_logprobs
                    last = ch
                print()
                result = last
            else:
                result = stub.Generate(request, metadata=md, timeout=args.timeout)
                print(result.text)
                logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        except grpc.RpcError as exc:
            print(f"specserve client: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except UnsupportedField as exc:
            print(f"specserve client: {exc}", file=sys.stderr)
            return 2
    if args.prompt_logprobs is not None:
        print("prompt:", file=sys.stderr)
        print(format_logprobs(prompt_logprobs), file=sys.stderr)
    if args.logprobs is not None:
        print(format_logprobs(logprobs), file=sys.stderr)
    if result is not None:
        s = result.spec
        print(f"[route={_path_name(result.route.path)} reason={result.route.reason} "
              f"tokens={result.usage.completion_tokens} cached_prompt={result.usage.cached_prompt_tokens} "
              f"drafted={s.draft_tokens} accepted={s.accepted_tokens} "
              f"alpha={s.alpha:.2f} acceptance_rate={s.acceptance_rate:.2f} "
              f"mean_accept_len={s.mean_acceptance_length:.2f}"
              + (f" prediction_kept={result.usage.accepted_prediction_tokens}"
                 f" prediction_dropped={result.usage.rejected_prediction_tokens}" if args.prediction else "")
              + "]",
              file=sys.stderr)
    return 0
