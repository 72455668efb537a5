package lua

import (
	"context"
	_ "embed"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed unlock.lua
	unlockSrc string

	unlockScript = redis.NewScript(unlockSrc)
)

// Sentinel errors of Unlock.
var (
	// ErrLockLost: the lock no longer exists (it expired or was deleted).
	ErrLockLost = errors.New("lua: lock lost: it expired or was deleted")
	// ErrLockNotOwner: the lock exists but another owner holds it.
	ErrLockNotOwner = errors.New("lua: lock held by another owner")
)

// Unlock deletes the lock at key (a STRING holding its owner's token, taken with SET NX PX,
// e.g. Keys.RobotsLock) only while its value is still owner, in one atomic script
// (unlock.lua). A holder whose lock expired — and was perhaps taken by another since —
// gets ErrLockLost or ErrLockNotOwner and deletes nothing; either way it no longer holds
// the lock. The script touches only key, so it runs on Redis Cluster whatever the key's
// name.
func Unlock(ctx context.Context, rdb redis.Scripter, key, owner string) error {
	switch {
	case key == "":
		return errors.New("lua: unlock: empty key")
	case owner == "":
		return fmt.Errorf("lua: unlock %q: empty owner", key)
	}
	n, err := unlockScript.Run(ctx, rdb, []string{key}, owner).Int64()
	return unlockErr(key, n, err)
}

// unlockErr is the one place that maps unlock.lua's reply (or the error of its call) to an
// error; a malformed reply is an error, never a panic.
func unlockErr(key string, n int64, err error) error {
	if err != nil {
		return fmt.Errorf("lua: unlock %q: %w", key, err)
	}
	switch n {
	case 1:
		return nil
	case -1:
		return fmt.Errorf("lua: unlock %q: %w", key, ErrLockLost)
	case -2:
		return fmt.Errorf("lua: unlock %q: %w", key, ErrLockNotOwner)
	}
	return fmt.Errorf("lua: unlock %q: unexpected reply %d", key, n)
}
