"""Running the dashboard's processes: the web server, the Celery worker and beat, Redis.

Used by ``manage.py up`` (one command that starts everything and stops it cleanly) and by
the test fixtures in ``tests/infra.py``, so that tests start real processes exactly the way
an operator does.
"""
