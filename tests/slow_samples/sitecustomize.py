"""For tests/test_elastic.py: what tests/fault_injection does (RECORD_SAMPLES among it), and every image
load SLOW_SAMPLE_S seconds slower, so that an epoch of a tiny run lasts long enough for a machine to join
it and another to leave it. Loaded by every Python process whose PYTHONPATH starts with this folder."""

import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, "fault_injection", "sitecustomize.py"))

if "SLOW_SAMPLE_S" in os.environ:
    import time

    import my_dataset

    _getitem = my_dataset.MyDataSet.__getitem__

    def _slow_getitem(self, index):
        time.sleep(float(os.environ["SLOW_SAMPLE_S"]))
        return _getitem(self, index)

    my_dataset.MyDataSet.__getitem__ = _slow_getitem
