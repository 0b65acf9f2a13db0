"""On PYTHONPATH for scripts/tp_hang_probe.py: every process (the spawned ranks too) dumps its threads'
stacks to $OUT/tb_<pid>.txt after TP_DUMP_AFTER seconds (a hang's whereabouts)."""
import faulthandler
import os

_after = float(os.environ.get("TP_DUMP_AFTER", "0") or 0)
if _after > 0:
    _f = open(os.path.join(os.environ.get("OUT", "."), f"tb_{os.getpid()}.txt"), "w")
    faulthandler.dump_traceback_later(_after, exit=False, file=_f)
