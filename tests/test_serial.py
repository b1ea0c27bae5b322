"""schedulers.serial: one stream, program order, no waits."""

from __future__ import annotations

from schedulers import serial
from tests.dags import diamond


def test_serial_has_no_waits_and_keeps_program_order():
    s = serial(diamond(), num_streams=8)
    assert s.waits == () and s.num_streams == 1 and s.order == ("a", "b", "c", "d")
    assert s.makespan == 22.0
