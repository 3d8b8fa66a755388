from django.db import migrations

# Each team's queue depth as two counters kept by triggers, on PostgreSQL: `in`, jobs that entered
# the queue ('queued'), and `out`, jobs that left it; depth = in - out. The submit reads it under
# its lock in the statement that writes the job, instead of counting the queue (scheduler/services/
# submit.py explains why that is exact). No Django model: only that statement reads it, and SQLite
# (whose writers are serialized) counts instead.
#
# Who writes which row, and when, so that no two transactions can deadlock on them and claims never
# wait for submits:
#   - a job inserted queued: `in`, by a statement trigger, in ascending team order (a submit, which
#     already holds those rows: it locked them after its team rows);
#   - a job that leaves the queue (claim, cancel, delete): `out`; a job that enters it again
#     (recovery, requeue, retry, a flow's next round): `in`. A row trigger notes each change in a
#     transaction-local setting, and a deferred trigger applies them all at commit in ascending
#     (team, side) order: the last locks the transaction takes, all in one order, held only while it
#     commits. `out` only grows, so the submit may read it from its snapshot: a claim it does not
#     see yet makes the depth it reads higher, never lower.
#   - TRUNCATE of the jobs sets every counter to 0; a new team gets its two rows, a deleted team
#     loses them. No foreign key: Django's flush (tests) truncates the tables it knows of.

TABLE = """
CREATE TABLE scheduler_queue_tally (
    team_id bigint NOT NULL,
    side text NOT NULL CHECK (side IN ('in', 'out')),
    n bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (team_id, side)
);
INSERT INTO scheduler_queue_tally (team_id, side, n)
SELECT t.id, s.side, CASE WHEN s.side = 'in' THEN
    (SELECT count(*) FROM scheduler_job j WHERE j.team_id = t.id AND j.status = 'queued') ELSE 0 END
FROM telemachus_team t CROSS JOIN (VALUES ('in'), ('out')) AS s (side);
"""

FUNCTIONS = """
CREATE FUNCTION scheduler_queue_tally_team() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM scheduler_queue_tally WHERE team_id = OLD.id;
    ELSE
        -- A new team has no jobs (an id used again after a TRUNCATE starts from 0 too).
        INSERT INTO scheduler_queue_tally (team_id, side, n) VALUES (NEW.id, 'in', 0), (NEW.id, 'out', 0)
        ON CONFLICT (team_id, side) DO UPDATE SET n = 0;
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION scheduler_queue_tally_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r record;
BEGIN
    FOR r IN SELECT team_id, count(*) AS n FROM inserted WHERE status = 'queued' GROUP BY team_id ORDER BY team_id
    LOOP
        UPDATE scheduler_queue_tally SET n = n + r.n WHERE team_id = r.team_id AND side = 'in';
    END LOOP;
    RETURN NULL;
END $$;

CREATE FUNCTION scheduler_queue_tally_note() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE noted text := coalesce(current_setting('telemachus.queue_tally', true), '');
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.status = 'queued' THEN
        noted := noted || OLD.team_id || ' out,';
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.status = 'queued' THEN
        noted := noted || NEW.team_id || ' in,';
    END IF;
    PERFORM set_config('telemachus.queue_tally', noted, true);
    RETURN NULL;
END $$;

CREATE FUNCTION scheduler_queue_tally_apply() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    noted text := coalesce(current_setting('telemachus.queue_tally', true), '');
    r record;
BEGIN
    IF noted = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('telemachus.queue_tally', '', true);
    FOR r IN
        SELECT split_part(e, ' ', 1)::bigint AS team_id, split_part(e, ' ', 2) AS side, count(*) AS n
        FROM unnest(string_to_array(noted, ',')) AS e WHERE e <> ''
        GROUP BY 1, 2 ORDER BY 1, 2
    LOOP
        UPDATE scheduler_queue_tally SET n = n + r.n WHERE team_id = r.team_id AND side = r.side;
    END LOOP;
    RETURN NULL;
END $$;

-- What this transaction noted for a team's row and has not applied yet: the submit adds it to what
-- it reads, so a transaction sees its own changes (and a test that never commits, all of them).
CREATE FUNCTION scheduler_queue_noted(team bigint, side text) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM unnest(string_to_array(current_setting('telemachus.queue_tally', true), ',')) AS e
    WHERE e = team || ' ' || side
$$;

CREATE FUNCTION scheduler_queue_tally_reset() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE scheduler_queue_tally SET n = 0 WHERE n <> 0;
    RETURN NULL;
END $$;
"""

# A status change that moves a job into or out of the queue (or a queued job to another team).
MOVED = "((OLD.status = 'queued') <> (NEW.status = 'queued') OR (OLD.status = 'queued' AND OLD.team_id <> NEW.team_id))"

TRIGGERS = f"""
CREATE TRIGGER scheduler_queue_tally_team AFTER INSERT OR DELETE ON telemachus_team
    FOR EACH ROW EXECUTE FUNCTION scheduler_queue_tally_team();
CREATE TRIGGER scheduler_queue_tally_inserted AFTER INSERT ON scheduler_job
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION scheduler_queue_tally_inserted();
CREATE TRIGGER scheduler_queue_tally_note_update AFTER UPDATE OF status, team_id ON scheduler_job
    FOR EACH ROW WHEN {MOVED} EXECUTE FUNCTION scheduler_queue_tally_note();
CREATE TRIGGER scheduler_queue_tally_note_delete AFTER DELETE ON scheduler_job
    FOR EACH ROW WHEN (OLD.status = 'queued') EXECUTE FUNCTION scheduler_queue_tally_note();
CREATE CONSTRAINT TRIGGER scheduler_queue_tally_apply_update AFTER UPDATE OF status, team_id ON scheduler_job
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN {MOVED} EXECUTE FUNCTION scheduler_queue_tally_apply();
CREATE CONSTRAINT TRIGGER scheduler_queue_tally_apply_delete AFTER DELETE ON scheduler_job
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (OLD.status = 'queued')
    EXECUTE FUNCTION scheduler_queue_tally_apply();
CREATE TRIGGER scheduler_queue_tally_reset AFTER TRUNCATE ON scheduler_job
    FOR EACH STATEMENT EXECUTE FUNCTION scheduler_queue_tally_reset();
"""

DROP = """
DROP TABLE IF EXISTS scheduler_queue_tally;
DROP TRIGGER IF EXISTS scheduler_queue_tally_team ON telemachus_team;
DROP TRIGGER IF EXISTS scheduler_queue_tally_inserted ON scheduler_job;
DROP TRIGGER IF EXISTS scheduler_queue_tally_note_update ON scheduler_job;
DROP TRIGGER IF EXISTS scheduler_queue_tally_note_delete ON scheduler_job;
DROP TRIGGER IF EXISTS scheduler_queue_tally_apply_update ON scheduler_job;
DROP TRIGGER IF EXISTS scheduler_queue_tally_apply_delete ON scheduler_job;
DROP TRIGGER IF EXISTS scheduler_queue_tally_reset ON scheduler_job;
DROP FUNCTION IF EXISTS scheduler_queue_tally_team, scheduler_queue_tally_inserted, scheduler_queue_tally_note,
    scheduler_queue_tally_apply, scheduler_queue_tally_reset, scheduler_queue_noted;
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTIONS + TRIGGERS + TABLE)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    """The queue tally (PostgreSQL): each team's queue depth kept by triggers, read by the submit."""

    dependencies = [
        ("scheduler", "0014_affinity"),
        ("telemachus", "0005_api_keys"),
    ]

    operations = [migrations.RunPython(install, uninstall)]
