"""%distrain connect refuses connection files and profiles others could write."""

from __future__ import annotations

import json
import os

import pytest

from nbdist import ClusterError
from nbdist.kernel.cluster import LocalCluster
from nbdist.kernel.connfile import check_connection_file, check_profile

OTHER_UID = 4242


def _file(folder, **info):
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / "ipcontroller-client.json"
    path.write_text(json.dumps({"interface": "tcp://127.0.0.1", "pack": "json", **info}))
    path.chmod(0o600)
    return path


def test_private_file_with_standard_serializers_passes(tmp_path):
    check_connection_file(_file(tmp_path / "sec"))
    check_connection_file(_file(tmp_path / "sec", pack="pickle", unpack="pickle"))


def test_group_writable_file_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    path.chmod(0o620)
    with pytest.raises(ClusterError) as e:
        check_connection_file(path)
    assert str(e.value) == (
        f"%distrain connect: the connection file {path} is writable by other users (mode 620), "
        f"who could then run code in this kernel. If it is yours, run: chmod go-w {path}"
    )


def test_world_writable_folder_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    path.parent.chmod(0o777)
    with pytest.raises(ClusterError, match="the folder of the connection file .* is writable by"):
        check_connection_file(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="a file owned by another uid needs root")
def test_file_of_another_user_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ClusterError) as e:
        check_connection_file(path)
    assert str(e.value) == (
        f"%distrain connect: the connection file {path} belongs to uid {OTHER_UID}, not to "
        f"you (uid {os.getuid()}): whoever owns it could run code in this kernel. Use a "
        "connection file or profile of your own."
    )


def test_unknown_serializer_is_refused(tmp_path):
    path = _file(tmp_path / "sec", unpack="os.system")
    with pytest.raises(ClusterError) as e:
        check_connection_file(path)
    assert str(e.value) == (
        f"%distrain connect: {path} asks for unpack='os.system'; nbdist accepts only "
        "ipyparallel's standard serializers (json, pickle), since ipyparallel would import "
        "and run any other name."
    )


def test_file_that_is_not_json_is_refused(tmp_path):
    path = _file(tmp_path / "sec")
    path.write_text("{")
    with pytest.raises(ClusterError, match=r"cannot read .* as JSON"):
        check_connection_file(path)


def test_profile_folder_and_its_files_are_checked(tmp_path):
    profile = tmp_path / "profile_x"
    security = profile / "security"
    profile.mkdir(mode=0o700)
    path = _file(security)
    path.rename(security / "ipcontroller-abc-client.json")
    check_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    profile.chmod(0o777)
    with pytest.raises(ClusterError, match="the profile folder .* is writable by other users"):
        check_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    profile.chmod(0o700)
    security.chmod(0o733)
    with pytest.raises(ClusterError, match="the profile's security folder .* is writable"):
        check_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    security.chmod(0o700)
    (security / "ipcontroller-abc-client.json").chmod(0o666)
    with pytest.raises(ClusterError, match="the connection file .* is writable by other users"):
        check_profile(profile=None, profile_dir=str(profile), cluster_id="abc")
    check_profile(profile=None, profile_dir=str(tmp_path / "missing"), cluster_id=None)


def test_connect_refuses_before_leaving_the_current_cluster(tmp_path):
    path = _file(tmp_path / "sec", pack="evil.pack")
    cluster = LocalCluster()
    with pytest.raises(ClusterError, match="asks for pack='evil.pack'"):
        cluster.connect(url_file=str(path), timeout=1)
    assert not cluster.running
