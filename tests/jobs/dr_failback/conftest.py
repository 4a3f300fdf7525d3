"""The fail-back setting's fixture, for every test module here."""

from tests.jobs.dr_failback.setting import dr  # noqa: F401
