-- +goose Up
-- The scheduler's record of every due window of every template (issue 21: no lost
-- window). A tick writes its row BEFORE it enqueues the window's specs, and marks it
-- enqueued after; a tick that fails leaves it failed (retried until its deadline). A due
-- window with no row, or whose row never reached 'enqueued', is a gap: listed by
-- `idemscrape windows -gaps`, counted by idemscrape_scheduler_window_gaps, filled by
-- `idemscrape windows -fill`. One row per template × window: a few per template and day.
CREATE TABLE schedule_windows (
    template    text        NOT NULL,
    "window"    text        NOT NULL,
    kind        text        NOT NULL,
    due_at      timestamptz NOT NULL,
    state       text        NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'enqueued', 'failed')),
    tries       integer     NOT NULL DEFAULT 1 CHECK (tries >= 1),
    specs       integer     NOT NULL DEFAULT 0, -- specs of the last successful tick
    enqueued    integer     NOT NULL DEFAULT 0, -- of them, jobs created or found already queued
    started_at  timestamptz NOT NULL DEFAULT now(),
    enqueued_at timestamptz,                    -- first successful tick
    last_error  text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (template, "window")
);
CREATE INDEX schedule_windows_due_idx ON schedule_windows (template, due_at);

-- +goose Down
DROP TABLE schedule_windows;
