//go:build !chaos_nounique

package store

// commitResultKey is the result's observation key in the commit statement, behind the
// results table's unique index. Its own file for the same reason as commitFence
// (commit_nounique.go is the broken build).
const commitResultKey = `i.obs_key`
