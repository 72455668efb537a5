// Package handlers runs idemscrape jobs: the runner every task of a registered kind passes
// through (lease → attempt → workflow → parse → commit → release), failure categories and
// their retry policy, and the registry where a service registers its job kinds.
//
// The lease protocol lives in lease.go: take the job's lease in Redis (package lua, one
// SET NX PX), start the attempt in PostgreSQL, which raises the job's fence by one and so
// issues the attempt's fencing token (store.JobStart), keep the lease renewed while the
// attempt runs, and make every later write of the attempt conditional on that token.
package handlers
