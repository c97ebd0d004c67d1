"""Cached hashes (plait.cached_hash): the same hash as the fields give, never stale after a copy is updated,
never carried into another process."""

import copy
import os
import pickle
import subprocess
import sys

from plait.cost.calibration import calibration_for
from plait.plan import Strategy
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS


def test_an_updated_copy_hashes_as_a_fresh_object_of_its_fields():
    s = Strategy(dp=4, tp=2, zero=1)
    hash(s)  # cache it
    t = s.model_copy(update={"tp": 4, "dp": 2})
    assert t == Strategy(dp=2, tp=4, zero=1)
    assert hash(t) == hash(Strategy(dp=2, tp=4, zero=1))
    assert "_hash" not in copy.copy(s).__dict__
    assert {t: 1}[Strategy(dp=2, tp=4, zero=1)] == 1


def test_the_cached_hash_is_left_out_of_pickles():
    objects = (Strategy(tp=8, sp=True), PRESETS["llama2-7b"], dgx(2, 8, "H100-80GB"), calibration_for("H100-80GB"))
    for obj in objects:
        hash(obj)
        assert "_hash" in obj.__dict__
        again = pickle.loads(pickle.dumps(obj))
        assert again == obj and "_hash" not in again.__dict__ and hash(again) == hash(obj)


def test_an_object_sent_to_another_process_is_found_there_by_an_equal_key():
    """String hashes differ between processes: a pickled cached hash would miss the equal key there."""
    sent = (Strategy(tp=2, recompute="full"), PRESETS["llama2-7b"])
    for obj in sent:
        hash(obj)  # cached here, where strings hash otherwise
    blob = pickle.dumps(sent)
    code = ("import pickle, sys; from plait.plan import Strategy; from plait.spec.model import PRESETS; "
            "s, m = pickle.loads(sys.stdin.buffer.read()); "
            "print({s: 1}.get(Strategy(tp=2, recompute='full'), 0), {m: 1}.get(PRESETS['llama2-7b'], 0))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()
        assert out == [b"1", b"1"]
