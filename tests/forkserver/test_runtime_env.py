"""forkserver/runtime.share_cores_between_engines: the spin a many-models server's engines get, and the
user's own OpenMP settings left alone."""

from __future__ import annotations

from hotstart.forkserver.runtime import import_env, share_cores_between_engines


def test_engines_that_share_cores_spin_briefly():
    env = {"PATH": "/bin"}
    assert share_cores_between_engines(env)
    assert env["GOMP_SPINCOUNT"] == "2000"
    assert import_env(env)["GOMP_SPINCOUNT"] == "2000"  # part of the forkserver's import environment


def test_the_users_own_wait_policy_or_spin_is_kept():
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "infinite"}, {"OMP_WAIT_POLICY": ""}):
        env = dict(given)
        assert not share_cores_between_engines(env)
        assert env == given
