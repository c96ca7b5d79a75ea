"""One's own images (jaxpar-dataset images): scikit-learn's digits built from numpy arrays and
trained data-parallel on 8x1x1 and 1x1x1 to the accuracy docs/data.md states; a folder of PNG
and JPEG class subfolders built and trained with the commands the guide gives; bad input."""
import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env

from jaxpar import config as jconfig
from jaxpar.commands import dataset as dataset_command
from jaxpar.commands import train as train_command
from jaxpar.data import make_loader, tfds_source

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The run docs/data.md states: 600 steps of 64 images, AdamW at 0.1, the whole test split
# evaluated at the end.
DIGITS_RUN = ["--steps", "600", "--no-progress", "--set", "train.batch_size=64", "train.lr=0.1",
              "data.eval_split=test", "train.eval_every=600", "train.eval_steps=0",
              "checkpoint.every=0"]
DIGITS_ACCURACY = 0.9333  # 336 of the 360 test images, on both layouts (docs/data.md)


def _digits():
  """scikit-learn's 1,797 8x8 digits (values 0..16), split 80/20 stratified with seed 0."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  d = load_digits()
  x_train, x_test, y_train, y_test = train_test_split(
      d.images.astype(np.uint8), d.target, test_size=0.2, random_state=0, stratify=d.target)
  return x_train, y_train, x_test, y_test


def _build(capsys, *argv):
  """jaxpar-dataset in process: (exit code, stdout, stderr)."""
  capsys.readouterr()
  code = dataset_command.main([str(a) for a in argv])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
  root = tmp_path_factory.mktemp("digits")
  x_train, y_train, x_test, y_test = _digits()
  np.savez(root / "digits.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  code = dataset_command.main(["images", str(root / "digits.npz"), "--data-dir",
                               str(root / "data"), "--name", "digits"])
  assert code == 0
  return root


def test_digits_reach_the_stated_accuracy_on_8x1x1_and_1x1x1(digits):
  """Both layouts train the same run from the built dataset; their test accuracy is the one
  the guide states, and equal (data parallelism changes only the sums' order)."""
  flags = ["model.kind=cnn", "data.source=tfds", "data.name=local_images/digits",
           f"data.data_dir={digits / 'data'}", "model.num_classes=10"]
  procs = {}
  for mesh in ("8x1x1", "1x1x1"):  # together: their start-ups and compiles overlap
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--mesh", mesh, "--workdir",
           str(digits / mesh), "--metrics-file", str(digits / f"{mesh}.jsonl"), *DIGITS_RUN,
           *flags]
    procs[mesh] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=child_env(), cwd=ROOT)
  evals = {}
  for mesh, proc in procs.items():
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (digits / f"{mesh}.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "eval_accuracy" in r and not r.get("final")]
    evals[mesh] = step_rows[-1]
    # the summary row repeats the last evaluation, with the step it followed
    final = rows[-1]
    assert final["final"] and final["eval_step"] == step_rows[-1]["step"]
    assert final["eval_accuracy"] == step_rows[-1]["eval_accuracy"]
  a, b = evals["8x1x1"], evals["1x1x1"]
  assert a["step"] == b["step"] == 600
  assert round(a["eval_accuracy"] * 360) == round(b["eval_accuracy"] * 360)  # the same images
  assert a["eval_accuracy"] >= 0.9 and a["eval_accuracy"] == pytest.approx(DIGITS_ACCURACY,
                                                                            abs=1e-4)
  assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-2)


def test_arrays_are_stored_exactly_in_a_shuffled_order(digits):
  """Every image and label of each split back as given (PNG is lossless), in an order whose
  halves (two processes' shards) each hold every class; the features the cnn reads."""
  x_train, y_train, x_test, y_test = _digits()
  ds = tfds_source.open_dataset("local_images/digits", str(digits / "data"))
  assert (ds.kind, ds.image_shape, ds.num_classes) == ("image", (8, 8, 1), 10)
  for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    source = tfds_source.data_source(ds, split)
    got = [source[i] for i in range(len(source))]
    assert sorted((r["image"][..., 0].tobytes(), int(r["label"])) for r in got) == \
        sorted((img.tobytes(), int(label)) for img, label in zip(x, y))
    labels = [int(r["label"]) for r in got]
    half = len(labels) // 2
    assert set(labels[:half]) == set(labels[half:]) == set(range(10))
    assert labels != sorted(labels)


def _write_folder(root, shape=(12, 10)):
  """3 classes x 6 images: PNG (grayscale and RGB) and JPEG, one hidden file and a README."""
  from PIL import Image
  rng = np.random.default_rng(0)
  for c, name in enumerate(["cat", "dog", "fish"]):
    (root / name).mkdir(parents=True)
    for i in range(6):
      pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
      pixels[..., c] = 255  # each class its own colour
      ext = "jpg" if i % 3 == 0 else "png"
      Image.fromarray(pixels).save(root / name / f"{i}.{ext}")
  (root / "cat" / ".DS_Store").write_bytes(b"\0\1")
  (root / "README.txt").write_text("not an image")


def test_an_image_folder_builds_and_trains_with_the_guides_commands(tmp_path, capsys,
                                                                   monkeypatch):
  folder = tmp_path / "pets"
  _write_folder(folder)
  code, out, err = _build(capsys, "images", folder, "--data-dir", tmp_path / "data", "--name",
                          "pets", "--validation", "0.2")
  assert code == 0, err
  assert "built local_images/pets (14 train and 4 validation images of 12x10x3, 3 classes" in err
  flags = out.split("--set ", 1)[1].split()
  assert flags == ["model.kind=cnn", "data.source=tfds", "data.name=local_images/pets",
                   f"data.data_dir={tmp_path / 'data'}", "model.num_classes=3"]
  assert sorted(os.listdir(tmp_path / "data")) == ["local_images"]  # no temporary folder left
  cfg = jconfig.load(None, flags + ["train.batch_size=4", "data.workers=0"])
  it = make_loader(cfg, "")
  batch = it.next()
  assert batch["image"].shape == (4, 12, 10, 3) and batch["image"].dtype == np.float32
  assert set(batch["label"]) <= {0, 1, 2}
  it.close()
  # the same folder with train/ and test/ subfolders keeps those splits
  split = tmp_path / "split"
  _write_folder(split / "train")
  _write_folder(split / "test", shape=(12, 10))
  code, _, err = _build(capsys, "images", split, "--data-dir", tmp_path / "data", "--name",
                        "split")
  assert code == 0 and "18 train and 18 test images" in err, err
  # training: one command, as the guide gives it
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  code = train_command.main(["--mesh", "8x1x1", "--workdir", str(tmp_path / "wd"), "--steps", "3",
                             "--no-progress", "--set", *flags, "train.batch_size=8"])
  assert code == 0 and "steps: 3" in capsys.readouterr().out


def test_a_folders_labels_are_its_sorted_class_folders_in_a_shuffled_order(tmp_path, capsys):
  """Each class folder holds images of one colour: label i of the stored dataset is the i-th
  class folder in sorted order, by its name and its colour; a folder read class by class is
  stored shuffled, the validation it holds out drawn from every class."""
  import tensorflow_datasets as tfds
  from PIL import Image
  colours = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}  # sorted
  folder = tmp_path / "colours"
  for name, rgb in colours.items():
    (folder / name).mkdir(parents=True)
    for i in range(8):
      Image.fromarray(np.full((4, 4, 3), rgb, np.uint8)).save(folder / name / f"{i}.png")
  code, _, err = _build(capsys, "images", folder, "--data-dir", tmp_path / "data", "--name",
                        "colours", "--validation", "0.25")
  assert code == 0 and "18 train and 6 validation images of 4x4x3, 3 classes" in err, err
  names = tfds.builder("local_images/colours", data_dir=str(tmp_path / "data")).info.features[
      "label"].names
  assert names == list(colours)
  ds = tfds_source.open_dataset("local_images/colours", str(tmp_path / "data"))
  labels = {}
  for split in ("train", "validation"):
    source = tfds_source.data_source(ds, split)
    rows = [source[i] for i in range(len(source))]
    for r in rows:
      assert tuple(r["image"][0, 0]) == colours[names[int(r["label"])]]
    labels[split] = [int(r["label"]) for r in rows]
  assert sorted(labels["train"] + labels["validation"]) == [0] * 8 + [1] * 8 + [2] * 8
  assert labels["train"] != sorted(labels["train"]) and len(set(labels["validation"])) > 1


def _one_error(code, err):
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
  return lines[0]


def test_bad_input_is_one_sentence_and_leaves_nothing(tmp_path, capsys):
  from PIL import Image
  data = tmp_path / "data"

  def refused(source, *extra, name="bad"):
    code, _, err = _build(capsys, "images", source, "--data-dir", data, "--name", name, *extra)
    line = _one_error(code, err)
    assert not data.exists() or set(os.listdir(data)) <= {"local_images"}, os.listdir(data)
    assert name == "parity" or not (data / "local_images" / name).exists()
    return line

  empty = tmp_path / "empty"
  (empty / "a").mkdir(parents=True)
  assert "holds no images" in refused(empty)
  assert "has no class subfolders" in refused(tmp_path / "empty" / "a")
  mixed = tmp_path / "mixed"
  _write_folder(mixed)
  Image.fromarray(np.zeros((5, 7), np.uint8)).save(mixed / "dog" / "small.png")
  assert "differ in size" in refused(mixed) and "--size" in refused(mixed)
  code, _, err = _build(capsys, "images", mixed, "--data-dir", data, "--name", "resized",
                        "--size", "6x5")
  assert code == 0 and "17 train and 2 validation images of 6x5x3" in err, err
  broken = tmp_path / "broken"
  _write_folder(broken)
  (broken / "fish" / "9.png").write_bytes(b"not a png")
  assert "broken/fish/9.png is not a readable image" in refused(broken)
  truncated = tmp_path / "truncated"  # a valid header: found only as the build decodes it
  _write_folder(truncated)
  buf = io.BytesIO()
  Image.fromarray(np.random.default_rng(1).integers(0, 256, (12, 10, 3), np.uint8)).save(buf, "PNG")
  (truncated / "dog" / "7.png").write_bytes(buf.getvalue()[:200])
  assert "dog/7.png could not be decoded" in refused(truncated)
  x, y = _digits()[:2]
  np.savez(tmp_path / "few.npz", images=x, labels=y[:-1])
  assert "one label per image" in refused(tmp_path / "few.npz")
  np.savez(tmp_path / "float.npz", images=x / 16.0, labels=y)
  assert "whole numbers 0..255" in refused(tmp_path / "float.npz")
  np.save(tmp_path / "x.npy", x)
  assert "--labels" in refused(tmp_path / "x.npy")
  np.savez(tmp_path / "other.npz", a=x)
  assert "needs `images` and `labels`" in refused(tmp_path / "other.npz")
  assert "does not exist" in refused(tmp_path / "nowhere")
  assert "lowercase" in refused(tmp_path / "x.npy", name="Bad-Name")
  # .npy images with string labels, then the same name again
  np.save(tmp_path / "y.npy", np.asarray(["odd", "even"])[y % 2])
  code, out, err = _build(capsys, "images", tmp_path / "x.npy", "--labels", tmp_path / "y.npy",
                          "--data-dir", data, "--name", "parity")
  assert code == 0 and "2 classes" in err and "model.num_classes=2" in out, err
  assert "already holds a dataset parity" in refused(tmp_path / "x.npy", "--labels",
                                                     tmp_path / "y.npy", name="parity")


IMAGES = ["model.kind=cnn", "data.source=images", "train.batch_size=8"]


def test_one_command_builds_an_image_folder_and_trains_on_it(tmp_path, capsys):
  """data.source=images data.path=FOLDER builds the folder under <workdir>/data at the first
  run, with the classes setting model.num_classes; its batches are those of the dataset
  jaxpar-dataset images builds from the same folder; a changed folder is rebuilt, an unchanged
  one reused, and processes sharing the data dir build it once."""
  from jaxpar.data import local_images
  folder, wd = tmp_path / "pets", tmp_path / "wd"
  _write_folder(folder)
  images = IMAGES + [f"data.path={folder}"]
  capsys.readouterr()
  assert train_command.main(["--mesh", "8x1x1", "--print-config", "--set", *images]) == 0
  assert "num_classes: 3\n" in capsys.readouterr().out
  code = train_command.main(["--mesh", "8x1x1", "--workdir", str(wd), "--steps", "2",
                             "--no-progress", "--set", *images])
  out = capsys.readouterr()
  assert code == 0 and "steps: 2" in out.out, out.err
  assert "built local_images/pets_" in out.err
  assert "(16 train and 2 validation images of 12x10x3, 3 classes" in out.err
  # the reference: the dataset the two-command form builds
  code, _, err = _build(capsys, "images", folder, "--data-dir", tmp_path / "ref", "--name", "pets")
  assert code == 0, err
  for split, batch in (("train", 8), ("validation", 2)):
    ref = jconfig.load(None, ["model.kind=cnn", "data.source=tfds", "data.name=local_images/pets",
                              f"data.data_dir={tmp_path / 'ref'}", "model.num_classes=3",
                              f"train.batch_size={batch}", "data.workers=0"])
    auto = jconfig.load(None, images + ["model.num_classes=3", "data.workers=0",
                                        f"train.batch_size={batch}"])
    a, b = make_loader(auto, str(wd), split=split), make_loader(ref, "", split=split)
    for _ in range(2):
      x, y = a.next(), b.next()
      np.testing.assert_array_equal(x["image"], y["image"])
      np.testing.assert_array_equal(x["label"], y["label"])
    a.close(), b.close()
  assert "built" not in capsys.readouterr().err  # reused
  from PIL import Image
  Image.fromarray(np.zeros((12, 10, 3), np.uint8)).save(folder / "dog" / "new.png")
  make_loader(auto, str(wd)).close()
  err = capsys.readouterr().err
  assert "changed since" in err and "(17 train and 2 validation images" in err, err
  assert len(os.listdir(wd / "data" / "local_images")) == 2  # the dataset and its lock
  # processes sharing a data dir: one builds, the others wait and find it built
  import concurrent.futures
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    got = list(pool.map(lambda _: local_images.prepare(str(folder), str(tmp_path / "shared")),
                        range(3)))
  assert len({name for name, _ in got}) == 1 and sum(built for _, built in got) == 1


def test_image_folder_bad_input_is_one_sentence(tmp_path, capsys):
  from PIL import Image
  folder = tmp_path / "pets"
  _write_folder(folder)

  def refused(*sets):
    capsys.readouterr()
    code = train_command.main(["--mesh", "8x1x1", "--workdir", str(tmp_path / "wd"), "--steps",
                               "1", "--no-progress", "--set", *IMAGES, *sets])
    line = _one_error(code, capsys.readouterr().err)
    assert not (tmp_path / "wd").exists()  # nothing built or written
    return line

  assert "has 3 classes, more than model.num_classes=2" in refused(f"data.path={folder}",
                                                                   "model.num_classes=2")
  assert "needs data.path" in refused()
  assert "does not exist" in refused(f"data.path={tmp_path / 'nowhere'}")
  np.save(tmp_path / "x.npy", np.zeros((4, 8, 8), np.uint8))
  assert "holds images only" in refused(f"data.path={tmp_path / 'x.npy'}")
  assert "data.image_size=big is not" in refused(f"data.path={folder}", "data.image_size=big")
  Image.fromarray(np.zeros((5, 7), np.uint8)).save(folder / "dog" / "small.png")
  assert "data.image_size=HEIGHTxWIDTH" in refused(f"data.path={folder}")
  cfg = jconfig.load(None, IMAGES + [f"data.path={folder}", "data.image_size=6x5",
                                     "data.workers=0"])
  it = make_loader(cfg, str(tmp_path / "wd"))
  assert it.next()["image"].shape == (8, 6, 5, 3)
  it.close()
