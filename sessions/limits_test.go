package sessions_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestBodyLimits(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{BigSize: 3 << 20})
	fetch := func(t *testing.T, path string, maxBytes int64) (*sessions.Bound, error) {
		t.Helper()
		s, err := e.provider.NewSession("US", 0, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), s, &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), MaxBodyBytes: maxBytes})
		require.NoError(t, err)
		t.Cleanup(b.Close)
		_, err = b.Get(e.site.URL + path)
		return b, err
	}

	t.Run("UnderTheCap", func(t *testing.T) {
		_, err := fetch(t, "/big", 4<<20)
		require.NoError(t, err)
	})
	t.Run("Oversized", func(t *testing.T) {
		_, err := fetch(t, "/big", 1<<20)
		require.ErrorIs(t, err, sessions.ErrBodyTooLarge)
		require.Equal(t, tasks.CategoryBodyTooLarge, sessions.CategoryOf(err))
		require.ErrorContains(t, err, "more than 1048576 bytes", "the error names the cap")
		require.ErrorContains(t, err, "MaxBodyBytes", "and what to change")
	})
	t.Run("GzipBomb", func(t *testing.T) {
		// ~1 MB on the wire inflating to 1 GiB: cut off at the (decompressed) cap, after
		// reading only a small part of the compressed stream.
		b, err := fetch(t, "/bomb", 10<<20)
		require.ErrorIs(t, err, sessions.ErrBodyTooLarge)
		require.Less(t, b.Bytes(), int64(1<<20), "only the start of the bomb was read")
		var fe *sessions.FetchError
		require.True(t, errors.As(err, &fe))
		require.Equal(t, tasks.CategoryBodyTooLarge, fe.Category)
	})
}
