//go:build !chaos_nofence && !chaos_nofencepred

package store

// commitFence is the commit statement's fence: a commit applies only while the job runs
// under the committing token. It lives in a file of its own only so that cmd/chaos can
// build a deliberately broken worker without it (commit_nofence.go) and prove that its
// harness notices; every shipped build uses this one.
const commitFence = ` AND j.fence = i.token AND j.state = 'running'`
