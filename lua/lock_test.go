package lua_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestUnlock: compare-and-delete of an owner-token lock, on real Redis and on miniredis
// (where the lock's expiry is fast-forwarded).
func TestUnlock(t *testing.T) {
	ctx := context.Background()
	type bundle struct {
		rdb redis.UniversalClient
		key string
		// expire makes the lock at key expire now.
		expire func(t *testing.T)
	}
	setups := map[string]func(t *testing.T) bundle{
		"Redis": func(t *testing.T) bundle {
			ns := testutil.Redis(t)
			keys, err := lua.NewKeys(ns.Prefix)
			require.NoError(t, err)
			key := keys.RobotsLock("https://shop.example")
			return bundle{rdb: ns.Client, key: key, expire: func(t *testing.T) {
				require.NoError(t, ns.Client.Del(ctx, key).Err()) // what an expiry leaves
			}}
		},
		"Miniredis": func(t *testing.T) bundle {
			c, mr := miniClient(t)
			keys, err := lua.NewKeys("mini:")
			require.NoError(t, err)
			return bundle{rdb: c, key: keys.RobotsLock("https://shop.example"), expire: func(*testing.T) {
				mr.FastForward(time.Hour)
			}}
		},
	}
	for name, setup := range setups {
		t.Run(name, func(t *testing.T) {
			t.Run("OwnLockDeleted", func(t *testing.T) {
				b := setup(t)
				require.NoError(t, b.rdb.Set(ctx, b.key, "me", time.Minute).Err())
				require.NoError(t, lua.Unlock(ctx, b.rdb, b.key, "me"))
				assert.Zero(t, b.rdb.Exists(ctx, b.key).Val(), "deleted")
			})
			t.Run("OtherOwnersLockKept", func(t *testing.T) {
				// Ours expired while we worked, and another worker took the lock since.
				b := setup(t)
				require.NoError(t, b.rdb.Set(ctx, b.key, "me", time.Minute).Err())
				b.expire(t)
				ok, err := b.rdb.SetNX(ctx, b.key, "other", time.Minute).Result()
				require.NoError(t, err)
				require.True(t, ok, "precondition: the other worker took the expired lock")
				err = lua.Unlock(ctx, b.rdb, b.key, "me")
				require.ErrorIs(t, err, lua.ErrLockNotOwner)
				assert.ErrorContains(t, err, b.key)
				assert.Equal(t, "other", b.rdb.Get(ctx, b.key).Val(), "the other's lock is untouched")
				assert.Greater(t, b.rdb.PTTL(ctx, b.key).Val(), time.Duration(0), "with its expiry")
			})
			t.Run("ExpiredLockIsLost", func(t *testing.T) {
				b := setup(t)
				require.NoError(t, b.rdb.Set(ctx, b.key, "me", time.Minute).Err())
				b.expire(t)
				require.ErrorIs(t, lua.Unlock(ctx, b.rdb, b.key, "me"), lua.ErrLockLost)
				assert.Zero(t, b.rdb.Exists(ctx, b.key).Val())
			})
			t.Run("BadInput", func(t *testing.T) {
				b := setup(t)
				assert.ErrorContains(t, lua.Unlock(ctx, b.rdb, "", "me"), "empty key")
				assert.ErrorContains(t, lua.Unlock(ctx, b.rdb, b.key, ""), "empty owner")
			})
		})
	}
}
