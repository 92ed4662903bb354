"""Generate with a target and an EAGLE draft head (speculative decoding), or chat with it.

    python -m infer.generate                                                       # the demo (below)
    python -m infer.generate --target DIR [--draft DIR] --prompt "Hello"          # stream one answer
    python -m infer.generate --config llama3.1-8b-eagle3 --models /models         # interactive chat
    python -m infer.generate --target DIR --draft DIR --prompt-ids '1,5,9;3,4' --max-new-tokens 20 --json OUT

--target/--draft take a store written by `convert.torch_to_orbax` (one directory that may hold both)
or Hugging Face / official EAGLE directories, loaded directly. Without a prompt it reads user turns
from stdin and keeps the conversation (exit with /exit or end of input). The tokenizer's chat
template is applied unless --raw. Text streams as cycles are accepted; a last line on stderr gives
new tokens, cycles, tau (new tokens per cycle) and tokens/s. `--json OUT` writes `output_ids` (new
tokens per row), `accept_lengths` (per row, per cycle), `cycles`, `new_tokens`, `tau` and more.

`--compare` then times the same prompts twice more after warm-up, speculatively and with the target
alone (both as one on-device loop, so printing does not count), shows the plain answer and the
speedup. Without --target and --config the demo pair answers a sample question (or --prompt) with its
tree, in float32, with --warmup and --compare: SmolLM2-135M-Instruct with its EAGLE-3 head
(demo/smollm2-eagle3) once `make demo` (`python -m cli.smollm2`) has converted it into the cache, else the
7.9M pair shipped in demo/target + demo/eagle3 (see `cli.demo`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cli import chat, command, demo, generation, models
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading


def parse_prompt_ids(text: str) -> list[list[int]]:
    """'1,5,9;3,4' -> [[1, 5, 9], [3, 4]] (rows separated by ';')."""
    try:
        rows = [[int(t) for t in row.split(",") if t.strip()] for row in text.split(";") if row.strip()]
    except ValueError:
        raise EagleError(
            f"bad --prompt-ids {text!r}: expected comma-separated ids, rows separated by ';' (e.g. 1,5,9;3,4)"
        ) from None
    if not rows or not all(rows) or min(min(r) for r in rows) < 0:
        raise EagleError(f"bad --prompt-ids {text!r}: every row needs at least one id >= 0")
    return rows


def demo_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """No --target and no --config: the demo pair answers (`models.choose` picks it: SmolLM2-135M-Instruct + its
    head once `make demo` fetched it, else the 7.9M pair; `cli.demo`) a sample prompt, with --warmup --compare."""
    if a.target is not None or a.config is not None:
        return a
    a = argparse.Namespace(**vars(a))
    if a.prompt is None and a.prompt_file is None and a.prompt_ids is None:
        a.prompt = [demo.PROMPT]
    a.warmup = True
    a.compare = not a.no_spec
    a.demo = True
    return a


JSON_REPORT = files.json_with("output_ids", "accept_lengths")  # an earlier --json of this command


def _write_json(path: str, doc: dict) -> None:
    try:
        files.write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        raise EagleError(f"--json {path}: cannot write ({exc.strerror})") from None


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m infer.generate", description=__doc__.split("\n\n")[0])
    models.add_flags(p, draft_kind=True)
    inp = p.add_argument_group("input")
    inp.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    inp.add_argument("--prompt-file", help="file whose whole text is the prompt")
    inp.add_argument("--prompt-ids", help="raw token ids, rows separated by ';' (e.g. 1,5,9;3,4)")
    inp.add_argument("--system", help="system message for the chat template")
    inp.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen = p.add_argument_group("generation")
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"new tokens per row (default: preset, else {generation.DEFAULT_MAX_NEW_TOKENS})",
    )
    gen.add_argument(
        "--max-len",
        type=int,
        help="cache capacity in tokens (default: fits prompt and budget; chat: "
        f"{generation.CHAT_MAX_LEN}; at most max_position_embeddings)",
    )
    gen.add_argument("--temperature", type=float, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json-schema", metavar="FILE", help="answers follow this JSON schema (a JSON file)")
    gen.add_argument("--regex", metavar="R", help="answers match this regular expression")
    gen.add_argument("--choice", metavar="A,B,...", help="answers are one of these comma-separated strings")
    gen.add_argument("--no-spec", action="store_true", help="plain decoding with the target alone")
    gen.add_argument("--no-stream", action="store_true", help="run all cycles in one on-device loop; print at the end")
    gen.add_argument("--warmup", action="store_true", help="compile with one untimed run first")
    gen.add_argument(
        "--compare",
        action="store_true",
        help="then time speculative and plain decoding of the same prompts (after warm-up) and print the speedup",
    )
    models.add_tree_flags(p)
    p.add_argument("--json", metavar="OUT", help="write output ids, accept lengths and statistics to OUT")
    a = p.parse_args(argv, namespace=argparse.Namespace(demo=False))
    if a.compare and a.no_spec:
        raise EagleError("--compare compares speculative with plain decoding: drop --no-spec")
    if sum(x is not None for x in (a.prompt, a.prompt_file, a.prompt_ids)) > 1:
        raise EagleError("give only one of --prompt, --prompt-file, --prompt-ids")
    return a


def read_texts(a: argparse.Namespace) -> list[str] | None:
    """The prompt texts: --prompt (repeated), or --prompt-file's whole text; None when neither is given."""
    if a.prompt_file is None:
        return a.prompt
    try:
        return [Path(a.prompt_file).read_text(encoding="utf-8")]
    except OSError as exc:
        raise EagleError(f"--prompt-file {a.prompt_file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise EagleError(
            f"--prompt-file {a.prompt_file}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None


def encode(a: argparse.Namespace, m: models.Models, ids, texts: list[str], tok, use_template: bool) -> list[list[int]]:
    """The prompts as token ids: --prompt-ids checked against the vocabulary, or the texts in the chat template."""
    if ids is not None:
        if max(max(r) for r in ids) >= m.tcfg.vocab_size:
            raise EagleError(
                f"--prompt-ids: id {max(max(r) for r in ids)} is outside the vocabulary (0..{m.tcfg.vocab_size - 1})"
            )
        return ids
    system = [{"role": "system", "content": a.system}] if a.system else []
    return [loading.encode_chat(tok, system + [{"role": "user", "content": t}], use_template) for t in texts]


def answer(a: argparse.Namespace, m: models.Models, s: generation.Settings, prompts, tok) -> dict:
    """Generate (one row streams as text), print the rows and the figures; the --json document."""
    single = len(prompts) == 1
    printer = (chat.TextStream(tok) if tok is not None else chat.print_ids) if single else None
    outcome = generation.generate_timed(m, prompts, s, printer)
    if single:
        print(flush=True)
    else:
        generation.show_rows(outcome, tok)
    print(generation.stats_line(outcome, s.decode.tree.drafts), file=sys.stderr, flush=True)
    doc = generation.report(outcome, prompts, m, s, a)
    if a.compare:
        doc["compare"] = generation.compare(m, prompts, s, outcome, tok)
    return doc


def _main(argv: Sequence[str] | None) -> int:
    a = demo_defaults(parse_args(argv))
    pair = models.choose(a, plain=a.no_spec, fallback=", or --no-spec for plain decoding")
    if a.json:
        inputs = [p for p in (a.prompt_file, pair.target, pair.draft, a.config) if p]
        files.check_output_file(a.json, "json", inputs, JSON_REPORT)
    ids = parse_prompt_ids(a.prompt_ids) if a.prompt_ids is not None else None
    texts = read_texts(a)
    for flag, given in (("--json", a.json), ("--compare", a.compare)):
        if given and ids is None and texts is None:
            raise EagleError(f"{flag} needs a prompt (--prompt, --prompt-file or --prompt-ids)")
    if pair.note:
        print(pair.note, file=sys.stderr, flush=True)
    template = pair.preset.chat_template if pair.preset else None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the tokenizer (seconds of imports) loads meanwhile
        tokenizer = None if ids is not None else pool.submit(generation.load_tokenizer, pair.target, template)
        m = models.load(pair)
        s = generation.settings_from_args(a, pair.preset, m)
        if ids is None and texts is None:  # the chat's programs start compiling before it needs the tokenizer
            s = generation.resolve_tree(m, s, 1, tokenizer.result, a.auto_budget)
            chat.chat(m, tokenizer.result, s, a.raw, a.system)
            return 0
        tok = tokenizer.result() if tokenizer else None
    prompts = encode(a, m, ids, texts, tok, generation.uses_chat_template(tok, a.raw))
    s = generation.resolve_tree(
        m, s, len(prompts), None if tokenizer is None else tokenizer.result, a.auto_budget, prompts
    )
    if a.demo:
        shown = texts[0] if texts else prompts[0]
        kind = "speculative" if s.decode.tree.drafts else "plain"
        print(f"demo: {generation.pair_name(m, s.decode.tree)}; {kind} answer to: {shown}", file=sys.stderr)
    doc = answer(a, m, s, prompts, tok)
    if a.json:
        _write_json(a.json, doc)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    command.finish(main())
