"""The run card's package list: read from the metadata folders' names, the same as
importlib.metadata's (which parses every METADATA file: 0.2-0.7 s of rank 0's interpreter)."""

from importlib import metadata

from scaletrain.tracking.run_card import canonical_name, compare_run_cards, installed_packages


def test_the_package_list_is_what_importlib_metadata_lists():
    expected = {f"{canonical_name(d.metadata['Name'])}=={d.version}"
                for d in metadata.distributions() if d.metadata["Name"]}
    listed = installed_packages()
    assert set(listed) == expected and len(listed) == len(expected)
    assert listed == sorted(listed, key=lambda line: line.split("==")[0])  # by name
    assert f"torch=={metadata.version('torch')}" in listed


def test_a_package_spelled_another_way_is_the_same_package():
    old = {"packages": ["PyYAML==6.0", "scikit_learn==1.5.0", "Torch==2.13.0"]}
    new = {"packages": ["pyyaml==6.0", "scikit-learn==1.5.0", "torch==2.14.0"]}
    assert compare_run_cards(old, new) == ["package torch: 2.13.0 -> 2.14.0"]


def test_building_a_run_card_starts_no_process(monkeypatch):
    """Rank 0 builds it in a thread while its DataLoader may fork workers: a subprocess started
    then can wait forever on a fork that inherited its status pipe (it hung a test run). The git
    state comes from the launcher; the OS's name is platform.platform()'s without `uname -p`."""
    import platform
    import subprocess
    import sys

    from scaletrain.tracking.run_card import build_run_card, os_name

    expected_os = subprocess.run([sys.executable, "-c", "import platform; print(platform.platform())"],
                                 capture_output=True, text=True, check=True).stdout.strip()

    def refuse(*args, **kwargs):
        raise AssertionError(f"the run card started a process: {args[:2]}")

    monkeypatch.setattr(platform, "_uname_cache", None)  # what a fresh worker has: nothing known yet
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    card = build_run_card({"seed": 1}, "sha256:x", 2, {"commit": "abc"})
    assert card["git"] == {"commit": "abc"} and card["os"] == os_name() == expected_os
