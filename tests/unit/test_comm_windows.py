"""The stderr filter around shared-window creation (comm/windows.py), without MPI."""
import os
import threading

from hpctrain.comm import windows

LINE = b"[vm:1] /openmpi/ompi/mca/osc/ucx/osc_ucx_component.c:375  Error: " + windows.NOISE + b" \n"


def _forwarded(chunks):
    read_end, write_end = os.pipe()
    out_r, out_w = os.pipe()
    reader = threading.Thread(target=windows.forward, args=(read_end, out_w))
    reader.start()
    for chunk in chunks:
        os.write(write_end, chunk)
    os.close(write_end)
    reader.join(timeout=10)
    os.close(out_w)
    with os.fdopen(out_r, "rb") as f:
        return f.read()


def test_forward_drops_only_the_osc_ucx_message_and_its_blank_line():
    text = b"before\n" + LINE + b" \n" + b"after\n\nlast without newline"
    assert _forwarded([text]) == b"before\nafter\n\nlast without newline"


def test_forward_joins_lines_split_across_reads():
    text = b"one\n" + LINE + b" \n" + b"two\n"
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    assert _forwarded(pieces) == b"one\ntwo\n"


def test_the_filter_passes_other_output_through_fd_2(capfd, monkeypatch):
    monkeypatch.setattr(windows, "_filter_wanted", True)
    with windows._without_osc_noise():
        os.write(2, b"kept\n" + LINE + b" \n")
        os.write(2, b"also kept\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "kept\nalso kept\nafter\n"


def test_no_filter_unless_mpi_started_before_hpctrain(capfd, monkeypatch):
    monkeypatch.setattr(windows, "_filter_wanted", False)
    with windows._without_osc_noise():
        os.write(2, LINE)
    assert windows.NOISE.decode() in capfd.readouterr().err
