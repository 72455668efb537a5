package lua_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestTrimStream: TrimStream removes only entries every group delivered and acknowledged,
// and reports the floor it trimmed to.
func TestTrimStream(t *testing.T) {
	ctx := context.Background()

	type group struct {
		name    string
		deliver int   // entries read by the group (from the start)
		ack     []int // indexes acknowledged
	}
	tests := []struct {
		name        string
		entries     int
		groups      []group
		wantTrimmed int64
		wantKept    []int // indexes still in the stream
		wantFloor   int   // index of the entry the floor equals; -1: no floor, -2: after the last entry
	}{
		{"NoGroup", 5, nil, 0, []int{0, 1, 2, 3, 4}, -1},
		{"OldestPendingIsTheFloor", 10, []group{{"g", 10, []int{0, 1, 2, 5, 8}}}, 3, []int{3, 4, 5, 6, 7, 8, 9}, 3},
		{"UndeliveredKept", 10, []group{{"g", 6, []int{0, 1, 2, 3, 4, 5}}}, 6, []int{6, 7, 8, 9}, -3},
		{"AllConsumed", 4, []group{{"g", 4, []int{0, 1, 2, 3}}}, 4, nil, -2},
		{"SlowestGroupWins", 10, []group{{"fast", 10, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}}, {"slow", 4, []int{0, 1}}}, 2, []int{2, 3, 4, 5, 6, 7, 8, 9}, 2},
		{"GroupThatReadNothing", 5, []group{{"fast", 5, []int{0, 1, 2, 3, 4}}, {"new", 0, nil}}, 0, []int{0, 1, 2, 3, 4}, -4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns := testutil.Redis(t)
			stream := ns.Prefix + "stream:t"
			ids := make([]string, tt.entries)
			for i := range ids {
				id, err := ns.Client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"i", i}}).Result()
				require.NoError(t, err)
				ids[i] = id
			}
			for _, g := range tt.groups {
				require.NoError(t, ns.Client.XGroupCreate(ctx, stream, g.name, "0").Err())
				if g.deliver > 0 {
					require.NoError(t, ns.Client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: g.name, Consumer: "c",
						Streams: []string{stream, ">"}, Count: int64(g.deliver), Block: -1}).Err())
				}
				for _, i := range g.ack {
					require.NoError(t, ns.Client.XAck(ctx, stream, g.name, ids[i]).Err())
				}
			}
			n, floor, err := lua.TrimStream(ctx, ns.Client, stream)
			require.NoError(t, err)
			assert.Equal(t, tt.wantTrimmed, n)
			switch tt.wantFloor {
			case -1:
				assert.Empty(t, floor)
			case -2:
				assert.Equal(t, successor(t, ids[len(ids)-1]), floor, "first id after the last delivered entry")
			case -3:
				assert.Equal(t, successor(t, ids[5]), floor, "first id after the last delivered entry")
			case -4:
				assert.Equal(t, "0-1", floor, "a group that read nothing holds everything")
			default:
				assert.Equal(t, ids[tt.wantFloor], floor)
			}

			msgs, err := ns.Client.XRange(ctx, stream, "-", "+").Result()
			require.NoError(t, err)
			var kept []int
			for _, m := range msgs {
				i, err := strconv.Atoi(m.Values["i"].(string))
				require.NoError(t, err)
				kept = append(kept, i)
			}
			if diff := cmp.Diff(tt.wantKept, kept); diff != "" {
				t.Errorf("entries kept (-want +got):\n%s", diff)
			}
		})
	}

	t.Run("NoStream", func(t *testing.T) {
		ns := testutil.Redis(t)
		n, floor, err := lua.TrimStream(ctx, ns.Client, ns.Prefix+"stream:missing")
		require.NoError(t, err)
		assert.Zero(t, n)
		assert.Empty(t, floor)
	})

	t.Run("NotAStream", func(t *testing.T) {
		ns := testutil.Redis(t)
		key := ns.Prefix + "stream:string"
		require.NoError(t, ns.Client.Set(ctx, key, "x", 0).Err())
		n, _, err := lua.TrimStream(ctx, ns.Client, key)
		require.NoError(t, err)
		assert.Zero(t, n)
	})

	t.Run("MaxSequenceCarries", func(t *testing.T) {
		// A group whose last delivered id has the largest sequence: the floor is the next
		// millisecond, computed on strings (a Lua double would round).
		ns := testutil.Redis(t)
		stream := ns.Prefix + "stream:max"
		const last = "5-18446744073709551615"
		require.NoError(t, ns.Client.XAdd(ctx, &redis.XAddArgs{Stream: stream, ID: last, Values: []any{"i", 0}}).Err())
		require.NoError(t, ns.Client.XGroupCreate(ctx, stream, "g", "$").Err())
		n, floor, err := lua.TrimStream(ctx, ns.Client, stream)
		require.NoError(t, err)
		assert.Equal(t, int64(1), n)
		assert.Equal(t, "6-0", floor)
	})

	t.Run("EmptyKey", func(t *testing.T) {
		ns := testutil.Redis(t)
		_, _, err := lua.TrimStream(ctx, ns.Client, "")
		require.ErrorContains(t, err, "empty stream key")
	})
}

// successor is the stream id right after id (same millisecond, next sequence).
func successor(t *testing.T, id string) string {
	t.Helper()
	for i := len(id) - 1; i >= 0; i-- {
		if id[i] == '-' {
			seq, err := strconv.ParseUint(id[i+1:], 10, 64)
			require.NoError(t, err)
			return id[:i+1] + strconv.FormatUint(seq+1, 10)
		}
	}
	t.Fatalf("bad stream id %q", id)
	return ""
}
