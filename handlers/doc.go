// Package handlers runs idemscrape jobs: the runner every task of a registered kind passes
// through (lease → attempt → workflow → parse → commit → release), failure categories and
// their retry policy, and the registry where a service registers its job kinds.
//
// The lease protocol lives in lease.go: claim the job's lease in Redis (package lua), start
// the attempt in PostgreSQL under the lease's fencing token (store.JobStart raises the job's
// fence), keep the lease renewed while the attempt runs, and make every later write of the
// attempt conditional on that token.
package handlers
