// Package tasks hands jobs to the queue: the Enqueuer records each job's row in PostgreSQL
// and its asynq task (TaskID = the job key), deduplicated by key at both layers, and repairs
// a task asynq archived. Its trace helpers carry an enqueue's span into every attempt.
//
// The job vocabulary — Spec, its validation and normalisation, the key, the payload codec,
// failure categories, the destination policy — is package job, which imports no asynq,
// go-redis or OpenTelemetry; tasks names the same types for the code that enqueues.
package tasks
