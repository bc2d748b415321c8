"""%distrain connect refuses connection files and profiles others could write, reads each file
once (no check of a path followed by a second open of it), never through a symbolic link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nbdist import ClusterError
from nbdist.kernel import connfile
from nbdist.kernel.connfile import read_connection, read_profile

OTHER_UID = 4242
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="files of another uid need root")


def _file(folder, name="ipcontroller-client.json", **info):
    folder.mkdir(mode=0o700, exist_ok=True, parents=True)
    path = folder / name
    path.write_text(json.dumps({"interface": "tcp://127.0.0.1", "pack": "json", **info}))
    path.chmod(0o600)
    return path


def test_private_file_with_standard_serializers_passes(tmp_path):
    assert read_connection(_file(tmp_path / "sec"))["interface"] == "tcp://127.0.0.1"
    read_connection(_file(tmp_path / "sec", pack="pickle", unpack="pickle"))


def test_group_writable_file_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    path.chmod(0o620)
    with pytest.raises(ClusterError) as e:
        read_connection(path)
    assert str(e.value) == (
        f"%distrain connect: the connection file {path} is writable by other users (mode 620), "
        f"who could then run code in this kernel. If it is yours, run: chmod go-w {path}"
    )


def test_world_writable_folder_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    path.parent.chmod(0o777)
    with pytest.raises(ClusterError, match="the folder of the connection file .* is writable by"):
        read_connection(path)


@AS_ROOT
def test_file_of_another_user_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ClusterError) as e:
        read_connection(path)
    assert str(e.value) == (
        f"%distrain connect: the connection file {path} belongs to uid {OTHER_UID}, not to "
        f"you (uid {os.getuid()}): whoever owns it could run code in this kernel. Use a "
        "connection file or profile of your own."
    )


def test_unknown_serializer_is_refused(tmp_path):
    path = _file(tmp_path / "sec", unpack="os.system")
    with pytest.raises(ClusterError) as e:
        read_connection(path)
    assert str(e.value) == (
        f"%distrain connect: {path} asks for unpack='os.system'; nbdist accepts only "
        "ipyparallel's standard serializers (json, pickle), since ipyparallel would import "
        "and run any other name."
    )


def test_file_that_is_not_json_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    path.write_text("{")
    with pytest.raises(ClusterError, match=r"cannot read .* as JSON"):
        read_connection(path)


def test_a_missing_file_is_refused(tmp_path):
    """It used to skip every check (ipyparallel's own error would say so), and ipyparallel
    then opened whatever was at the path by the time it looked."""
    tmp_path.joinpath("sec").mkdir(mode=0o700)
    with pytest.raises(ClusterError, match="there is no connection file .*ipcontroller-client"):
        read_connection(tmp_path / "sec" / "ipcontroller-client.json")


def test_a_symbolic_link_is_never_followed(tmp_path):
    """Someone who can write the folder plants a link to a file of theirs: refused, though
    the file the link names would pass every check."""
    real = _file(tmp_path / "elsewhere")
    folder = tmp_path / "sec"
    folder.mkdir(mode=0o700)
    (folder / "ipcontroller-client.json").symlink_to(real)
    with pytest.raises(ClusterError, match="never through a symbolic link"):
        read_connection(folder / "ipcontroller-client.json")


def test_profile_folder_and_its_files_are_checked(tmp_path):
    profile = tmp_path / "profile_x"
    security = profile / "security"
    profile.mkdir(mode=0o700)
    _file(security, "ipcontroller-abc-client.json")
    info, expected = read_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    assert info["interface"] == "tcp://127.0.0.1" and expected is None
    profile.chmod(0o777)
    with pytest.raises(ClusterError, match="the profile folder .* is writable by other users"):
        read_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    profile.chmod(0o700)
    security.chmod(0o733)
    with pytest.raises(ClusterError, match="the profile's security folder .* is writable"):
        read_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    security.chmod(0o700)
    (security / "ipcontroller-abc-client.json").chmod(0o666)
    with pytest.raises(ClusterError, match="the connection file .* is writable by other users"):
        read_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    with pytest.raises(ClusterError, match="there is no profile folder"):
        read_profile(profile=None, profile_dir=str(tmp_path / "missing"), cluster_id=None)


def test_the_launchers_engine_count_comes_from_the_cluster_file(tmp_path):
    profile = tmp_path / "profile_ssh"
    _file(profile / "security")
    (profile / "security" / "cluster-.json").write_text(
        json.dumps({"engines": {"sets": {"a": {"n": 2}, "b": {"n": 2}}}})
    )
    (profile / "security" / "cluster-.json").chmod(0o600)
    assert read_profile(profile=None, profile_dir=str(profile), cluster_id=None)[1] == 4


@AS_ROOT
def test_a_folder_swapped_after_the_check_is_not_read(tmp_path, monkeypatch):
    """The race, as another user ran it: in a team folder anyone may write (not sticky), they
    rename the victim's private folder away and put their own in its place while the notebook
    leaves its current cluster (``before``, about a second). What ipyparallel is given is what
    was checked; nothing is read again by path."""
    team = tmp_path / "team"
    team.mkdir(mode=0o777)
    team.chmod(0o777)
    mine = _file(team / "sec", interface="tcp://127.0.0.1", key="mine")
    theirs = tmp_path / "theirs"
    _file(theirs, interface="tcp://127.0.0.1", key="", pack="pickle", unpack="pickle")
    for p in (theirs, theirs / "ipcontroller-client.json"):
        os.chown(p, OTHER_UID, OTHER_UID)

    def swap():  # what the other user does between the check and the read
        os.rename(team / "sec", team / "moved")
        os.rename(theirs, team / "sec")

    given = []

    class Client:
        def __init__(self, connection_info, timeout):
            given.append(connection_info)
            self._queue_handlers = {"apply_reply": print, "execute_reply": print}

    import ipyparallel

    monkeypatch.setattr(ipyparallel, "Client", Client)
    connfile.open_client(
        profile=None, cluster_id=None, profile_dir=None, url_file=str(mine), timeout=1,
        before=swap,
    )  # fmt: skip
    assert Path(team / "sec").stat().st_uid == OTHER_UID  # the swap happened
    assert given == [json.loads((team / "moved" / "ipcontroller-client.json").read_text())]
    assert given[0]["key"] == "mine"


def test_connect_refuses_before_leaving_the_current_cluster(tmp_path):
    from nbdist.kernel.session import Session

    path = _file(tmp_path / "sec", pack="evil.pack")
    session = Session(notify=lambda message: None)
    local = session.cluster
    with pytest.raises(ClusterError, match="asks for pack='evil.pack'"):
        session.connect(url_file=str(path), timeout=1)
    assert session.cluster is local and not local.running


# -- the configuration a healing starts engines with ---------------------------------------------
def _profile(tmp_path: Path) -> Path:
    folder = tmp_path / "profile_x"
    folder.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    return folder


def test_the_profiles_launcher_config_is_read_once_and_loaded_from_a_copy(tmp_path):
    folder = _profile(tmp_path)
    (folder / "ipcluster_config.py").write_text("c.SlurmLauncher.timelimit = '0:10:00'\n")
    (folder / "ipython_config.json").write_text('{"Cluster": {"engine_timeout": 7}}')
    for f in folder.iterdir():
        f.chmod(0o644)
    config = connfile.launcher_config(folder)
    assert config.SlurmLauncher.timelimit == "0:10:00"
    assert config.Cluster.engine_timeout == 7


@pytest.mark.parametrize("name", ["ipcluster_config.py", "ipengine_config.py"])
def test_a_config_file_others_could_write_is_never_run(tmp_path, name):
    """A group-writable config file (what umask 002 leaves) is code someone else could have
    written: the healing says which file and the fix, and never runs it."""
    folder = _profile(tmp_path)
    marker = tmp_path / "ran"
    (folder / name).write_text(f"open({str(marker)!r}, 'w').close()\n")
    (folder / name).chmod(0o664)
    with pytest.raises(ClusterError) as info:
        connfile.launcher_config(folder)
    assert str(info.value) == (
        f"the cluster's launcher was not used: the config file {folder / name} is writable by "
        "other users (mode 664), who could then run code in this kernel. If it is yours, run: "
        f"chmod go-w {folder / name}"
    )
    assert not marker.exists()


def test_a_linked_config_file_or_a_swappable_profile_is_refused(tmp_path):
    folder = _profile(tmp_path)
    elsewhere = tmp_path / "theirs.py"
    elsewhere.write_text("c = c\n")
    (folder / "ipcluster_config.py").symlink_to(elsewhere)
    with pytest.raises(ClusterError, match="never through a symbolic link"):
        connfile.launcher_config(folder)
    (folder / "ipcluster_config.py").unlink()
    os.chmod(tmp_path, 0o777)  # others may rename the profile folder away, and put theirs
    with pytest.raises(ClusterError, match=r"is writable by other users \(and not sticky\)"):
        connfile.launcher_config(folder)
    os.chmod(tmp_path, 0o1777)  # as /tmp: others may write, not rename what is this user's
    assert connfile.launcher_config(folder) == {}
