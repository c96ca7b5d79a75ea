"""Sample text from a checkpoint or a Hugging Face folder: jaxpar-generate (--workdir DIR |
--hf FOLDER [--chat [--system TEXT]]) --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N]
[--temperature T] [--top-k K] [--top-p P] [--stop-token ID [--stop-token ID ...]] [--seed S]
[--num-samples N] [--no-cache] [--mesh DxMxP] [--step N].
Also python -m jaxpar generate, or python scripts/generate.py in a checkout."""
from __future__ import annotations

import math
import os
import sys

from jaxpar.commands import cli
from jaxpar.parallel import mesh as jmesh


def main(argv=None) -> int:
  p = cli.Parser(description=__doc__)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="the training run's workdir (its latest checkpoint)")
  source.add_argument("--hf", metavar="FOLDER",
                      help="a Hugging Face model folder (jaxpar's export or any architecture "
                           "jaxpar reads), with its tokenizer")
  p.add_argument("--chat", action="store_true",
                 help="with --hf: each prompt is a user's message, rendered with the folder's "
                      "chat template; the assistant's reply is printed")
  p.add_argument("--system", help="with --chat: a system message before each prompt")
  p.add_argument("--prompt", action="append", default=None,
                 help="text the sample continues (a document's start); repeat it for a batch of "
                      "prompts of any lengths, sampled together")
  p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample")
  p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="sample among the fewest likeliest tokens holding this much probability "
                      "(1 = all)")
  p.add_argument("--stop-token", type=int, action="append", default=None, metavar="ID",
                 help="token id that ends a sample; repeat it for several, any of which ends "
                      "it (default: end-of-text, and with --hf the folder's eos_token_id(s) and "
                      "eos_token, a chat model's end of turn; -1: none)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
  p.add_argument("--no-cache", action="store_true",
                 help="recompute the whole window for every token (the slow reference path)")
  p.add_argument("--step", type=int, help="with --workdir: checkpoint step (default: the latest "
                                          "complete one)")
  p.add_argument("--mesh", default="1x1x1", help="data x model x pipeline to shard the parameters over")
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                 help="overrides of the checkpoint's (or folder's) config, e.g. "
                      "precision.compute_dtype=bfloat16")
  p.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)
  prompts = args.prompt if args.prompt is not None else [""]

  def body():
    for flag, given, needs, want in (("--chat", args.chat, args.hf, "--hf"),
                                     ("--system", args.system, args.chat, "--chat"),
                                     ("--step", args.step is not None, args.workdir, "--workdir")):
      if given and not needs:
        raise cli.ConfigError(f"{flag} needs {want}")
    shape = jmesh.parse(args.mesh)
    n = math.prod(shape)
    simulated = n > 1 and jmesh.ensure_cpu_devices(n)  # before JAX starts
    from jaxpar.interop import generate  # imports JAX: after the simulated device count is set

    # before the checkpoint is read, and before any other line: a bad value is one sentence
    generate.check_options(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                           args.num_samples, args.stop_token, args.seed, len(prompts))
    generate.check_mesh(shape)
    if simulated:
      print(f"jaxpar: simulating {n} CPU devices for mesh {args.mesh} "
            f"(XLA_FLAGS=--xla_force_host_platform_device_count={n})", file=sys.stderr)
    # A prompt is bytes: argv's str holds undecodable bytes as surrogates (surrogateescape),
    # which os.fsencode turns back into those bytes.
    raw = [os.fsencode(text) for text in prompts]
    if args.hf:
      from jaxpar.interop import hf  # only a folder needs the Hugging Face interop
      sampler = hf.sampler(args.hf, shape, args.set)
    else:
      sampler = generate.Sampler(args.workdir, shape, args.step, args.set)
    if args.chat:  # each prompt a user's message in the folder's chat template; the reply printed
      system = [{"role": "system", "content": args.system}] if args.system else []
      ids = [sampler.codec.encode(hf.render_chat(args.hf, system + [
          {"role": "user", "content": text.decode("utf-8", errors="replace")}]), start=False)
             for text in raw]
      out = sampler.sample_tokens(ids, args.max_new_tokens, args.temperature, args.top_k,
                                  args.top_p, args.seed, args.num_samples, args.stop_token,
                                  cache=not args.no_cache)
      for i, text in enumerate(sampler.texts(out, args.stop_token)):
        if i:
          print("\n" + "-" * 40)
        print(text)
      return 0
    longest = max(len(sampler.codec.encode(text)) for text in raw)
    note = sampler.window_note(longest, args.max_new_tokens)
    if note:
      print(f"jaxpar: {note}", file=sys.stderr)
    texts = sampler.generate(raw, args.max_new_tokens, args.temperature, args.top_k,
                             args.seed, args.num_samples, args.top_p, args.stop_token,
                             cache=not args.no_cache)
    for i, text in enumerate(texts):
      if i:
        print("\n" + "-" * 40)
      # the prompt shown as the samples are: invalid UTF-8 as U+FFFD
      print(raw[i // args.num_samples].decode("utf-8", errors="replace") + text)
    return 0
  return cli.guard(body, args.debug, exit_on_signal=True)


if __name__ == "__main__":
  sys.exit(main())
