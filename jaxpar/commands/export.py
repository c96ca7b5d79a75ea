"""Export a checkpoint: jaxpar-export --workdir DIR [--step N] --out FILE.safetensors
(one file, FILE.json beside it with the model config and jaxpar version), or --hf FOLDER (a
Hugging Face folder for `from_pretrained`: config.json, model.safetensors and the run's tokenizer
files; a LoRA run's adapters merged into its weights), or --peft FOLDER (a LoRA run's adapters
as a PEFT folder, for `PeftModel.from_pretrained` onto the model folder it started from). Also python -m jaxpar export, or python scripts/export.py in a checkout."""
from __future__ import annotations

import os
import sys

from jaxpar.commands import cli


def main(argv=None) -> int:
  p = cli.Parser(description=__doc__)
  p.add_argument("--workdir", required=True, help="the training run's workdir")
  p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
  out = p.add_mutually_exclusive_group(required=True)
  out.add_argument("--out", help="FILE.safetensors to write")
  out.add_argument("--hf", metavar="FOLDER", help="a Hugging Face model folder to write (gpt, llama)")
  out.add_argument("--peft", metavar="FOLDER",
                   help="a PEFT adapter folder to write (a run with train.lora_rank > 0)")
  p.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)

  def body():
    cli.check_outputs(("--hf", args.hf, "folder"), ("--peft", args.peft, "folder"),
                      ("--out", args.out, "file"))
    from jaxpar.interop import export  # imports JAX: only once the outputs are known to be writable
    if args.hf:
      from jaxpar.interop import hf  # only --hf needs the Hugging Face interop
      done = hf.export(args.workdir, args.hf, args.step)
      tokenizer = [n for n in hf.TOKENIZER_FILES if os.path.isfile(os.path.join(args.hf, n))]
      print(f"wrote {args.hf}/model.safetensors, config.json"
            + (", generation_config.json" if done.generation_config else "")
            + f" ({done.config['architectures'][0]})"
            + (f", and the run's tokenizer ({', '.join(tokenizer)})" if tokenizer else "")
            + _kept(done))
      return 0
    if args.peft:
      from jaxpar.interop import peft  # only --peft needs the adapter export
      adapter = peft.export(args.workdir, args.peft, args.step)
      print(f"wrote {args.peft}/adapter_model.safetensors and adapter_config.json (LoRA rank "
            f"{adapter['r']} on {', '.join(adapter['target_modules'])})")
      return 0
    info = export.export(args.workdir, args.out, args.step)
    print(f"wrote {args.out} ({info['n_tensors']} tensors, {info['n_params']:,} parameters, "
          f"step {info['step']}) and {export.config_path(args.out)}")
    return 0
  return cli.guard(body, args.debug, exit_on_signal=True)


def _kept(done) -> str:
  """The summary's last words: what of the model.init_from folder's fields the run changed."""
  if done.note:
    return f"; {done.note}"
  if not done.source:
    return ""
  if not done.changed:
    return f"; every field of {done.source}'s configs kept (the run changed none)"
  return (f"; every field of {done.source}'s configs kept but what the run changed: "
          + ", ".join(done.changed))


if __name__ == "__main__":
  sys.exit(main())
