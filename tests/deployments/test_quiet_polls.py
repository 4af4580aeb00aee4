"""The access-log filter for timer polls, on records shaped like Ray Serve's."""
import logging

from deployments.quiet_polls import QuietPolls, quiet_polls


def _record(msg: str, access: bool = True) -> logging.LogRecord:
    r = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, msg, None, None)
    if access:
        r.serve_access_log = True
    return r


def test_drops_only_successful_access_lines_of_the_named_methods():
    f = QuietPolls(("stats",))
    assert not f.filter(_record("CALL stats OK 1.2ms"))
    assert not f.filter(_record("10.0.0.7:51234 CALL stats OK 1.2ms"))  # client address logged
    assert f.filter(_record("CALL stats ERROR 5003.0ms"))  # a failing poll is worth a line
    assert f.filter(_record("CALL stats CANCELLED 2.0ms"))
    assert f.filter(_record("CALL generate OK 812.4ms"))
    assert f.filter(_record("CALL statsx OK 1.0ms"))
    assert f.filter(_record("CALL stats OK 1.2ms", access=False))  # not an access line
    assert f.filter(_record("CALL"))


def test_installed_once_per_method_set():
    logger = logging.getLogger("ray.serve")
    before = list(logger.filters)
    try:
        quiet_polls("address")
        quiet_polls("address")
        added = [f for f in logger.filters if f not in before]
        assert len(added) == 1 and added[0].methods == frozenset({"address"})
    finally:
        logger.filters[:] = before
