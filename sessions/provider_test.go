package sessions

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const canary = "CANARY-pw-7f3a9c"

func TestProviderUsernames(t *testing.T) {
	now := time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC)
	mk := func(p *Provider, err error) *Provider {
		t.Helper()
		require.NoError(t, err)
		return p
	}
	cases := []struct {
		name               string
		p                  *Provider
		country            string
		lifetime           time.Duration
		wantUser, wantPass string // regexps; SID stands for the session id
		gateway            string
	}{
		{"brightdata", mk(BrightData("hl_1234", "residential1", canary)), "us", 30 * time.Minute,
			`^brd-customer-hl_1234-zone-residential1-country-us-session-SID$`, `^` + canary + `$`, "brd.superproxy.io:33335"},
		{"brightdata any country", mk(BrightData("hl_1234", "residential1", canary)), "", 30 * time.Minute,
			`^brd-customer-hl_1234-zone-residential1-session-SID$`, `^` + canary + `$`, "brd.superproxy.io:33335"},
		{"oxylabs", mk(Oxylabs("acme", canary)), "US", 30 * time.Minute,
			`^customer-acme-cc-US-sessid-SID-sesstime-30$`, `^` + canary + `$`, "pr.oxylabs.io:7777"},
		{"decodo", mk(Decodo("acme", canary)), "de", 15 * time.Minute,
			`^user-acme-country-de-session-SID-sessionduration-15$`, `^` + canary + `$`, "gate.decodo.com:7000"},
		{"iproyal", mk(IPRoyal("acme", canary)), "US", 30 * time.Minute,
			`^acme$`, `^` + canary + `_country-us_session-SID_lifetime-30m$`, "geo.iproyal.com:12321"},
		{"iproyal seconds", mk(IPRoyal("acme", canary)), "US", 90 * time.Second,
			`^acme$`, `^` + canary + `_country-us_session-SID_lifetime-90s$`, "geo.iproyal.com:12321"},
		{"soax", mk(SOAX("123456", canary)), "us", 10 * time.Minute,
			`^package-123456-country-us-sessionid-SID-sessionlength-600$`, `^` + canary + `$`, "proxy.soax.com:5000"},
		// Lifetimes are rounded UP to the provider's unit, so the provider's session
		// outlives ours: 90 s is 2 minutes, never 1.
		{"oxylabs 90s rounds up", mk(Oxylabs("acme", canary)), "US", 90 * time.Second,
			`^customer-acme-cc-US-sessid-SID-sesstime-2$`, `^` + canary + `$`, "pr.oxylabs.io:7777"},
		{"oxylabs 30s is 1 minute", mk(Oxylabs("acme", canary)), "US", 30 * time.Second,
			`^customer-acme-cc-US-sessid-SID-sesstime-1$`, `^` + canary + `$`, "pr.oxylabs.io:7777"},
		{"oxylabs 10m1s rounds up", mk(Oxylabs("acme", canary)), "US", 10*time.Minute + time.Second,
			`^customer-acme-cc-US-sessid-SID-sesstime-11$`, `^` + canary + `$`, "pr.oxylabs.io:7777"},
		{"decodo 59m30s rounds up", mk(Decodo("acme", canary)), "de", 59*time.Minute + 30*time.Second,
			`^user-acme-country-de-session-SID-sessionduration-60$`, `^` + canary + `$`, "gate.decodo.com:7000"},
		{"soax 1500ms rounds up", mk(SOAX("123456", canary)), "us", 1500 * time.Millisecond,
			`^package-123456-country-us-sessionid-SID-sessionlength-2$`, `^` + canary + `$`, "proxy.soax.com:5000"},
		{"iproyal 90500ms rounds up", mk(IPRoyal("acme", canary)), "US", 90*time.Second + 500*time.Millisecond,
			`^acme$`, `^` + canary + `_country-us_session-SID_lifetime-91s$`, "geo.iproyal.com:12321"},
		{"iproyal 59m59.5s is 1h", mk(IPRoyal("acme", canary)), "US", time.Hour - 500*time.Millisecond,
			`^acme$`, `^` + canary + `_country-us_session-SID_lifetime-1h$`, "geo.iproyal.com:12321"},
		{"lifetime capped at 60 min", mk(Oxylabs("acme", canary)), "US", 5 * time.Hour,
			`^customer-acme-cc-US-sessid-SID-sesstime-60$`, `^` + canary + `$`, "pr.oxylabs.io:7777"},
		{"generic", mk(NewProvider("generic", "gw.example:8000", "{user}[-country-{country}]-session-{session}", "{pass}", "bob", canary, 0)), "fr", time.Minute,
			`^bob-country-fr-session-SID$`, `^` + canary + `$`, "gw.example:8000"},
	}
	sid := regexp.MustCompile(`^[a-z0-9]{8}$`)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, err := tc.p.NewSession(tc.country, tc.lifetime, now)
			require.NoError(t, err)
			require.Regexp(t, sid, s.ID, "session ids are 8 [a-z0-9], valid for every format")
			user, pass := s.creds()
			require.Regexp(t, strings.ReplaceAll(tc.wantUser, "SID", s.ID), user)
			require.Regexp(t, strings.ReplaceAll(tc.wantPass, "SID", s.ID), pass)
			require.Equal(t, tc.gateway, s.Endpoint)
			require.Equal(t, "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":"+pass)), s.proxyAuthorization())
			require.Equal(t, strings.ToUpper(tc.country), s.Country)
		})
	}
	t.Run("MinutesClampedToProviderMax", func(t *testing.T) {
		user, _ := mk(Oxylabs("acme", canary)).credentialsFor("US", "abcdefgh", 48*time.Hour)
		require.Equal(t, "customer-acme-cc-US-sessid-abcdefgh-sesstime-1440", user)
	})
	t.Run("SessionIDsDiffer", func(t *testing.T) {
		p := mk(Oxylabs("acme", canary))
		seen := map[string]bool{}
		for i := 0; i < 1000; i++ {
			s, err := p.NewSession("US", 0, now)
			require.NoError(t, err)
			require.False(t, seen[s.ID], "duplicate session id")
			seen[s.ID] = true
		}
	})
	t.Run("BadConfig", func(t *testing.T) {
		_, err := NewProvider("x", "user:pw@gw:1", "{user}", "{pass}", "u", "p", 0)
		require.ErrorContains(t, err, "without credentials")
		_, err = NewProvider("x", "gw:1", "{user}-{bogus}", "{pass}", "u", "p", 0)
		require.ErrorContains(t, err, "unknown placeholder {bogus}")
		_, err = NewProvider("x", "gw:1", "{user}", "{pass}", "u", "", 0)
		require.ErrorContains(t, err, "required")
		_, err = BrightData("id", "zone/../x", canary)
		require.Error(t, err)
		_, err = mk(Oxylabs("acme", canary)).NewSession("USA", 0, now)
		require.ErrorContains(t, err, "ISO 3166")
	})
}

func TestProviderFromEnv(t *testing.T) {
	t.Setenv(EnvProvider, "decodo")
	t.Setenv(EnvUser, "acme")
	t.Setenv(EnvPassword, canary)
	t.Setenv(EnvGateway, "127.0.0.1:7000")
	p, err := ProviderFromEnv()
	require.NoError(t, err)
	require.Equal(t, "decodo", p.Name())
	require.Equal(t, "127.0.0.1:7000", p.Gateway())

	t.Setenv(EnvProvider, "nope")
	_, err = ProviderFromEnv()
	require.ErrorContains(t, err, EnvProvider)
	require.NotContains(t, err.Error(), canary)
	t.Setenv(EnvPassword, "")
	_, err = ProviderFromEnv()
	require.ErrorContains(t, err, EnvPassword)
}

// TestProvidersFromEnv: the accounts in failover order, each with its own variables
// (suffix _2, _3 …); a second account of the same preset needs a name; gaps and bad
// values are refused naming the variable, never the password.
func TestProvidersFromEnv(t *testing.T) {
	t.Setenv(EnvProvider, "decodo")
	t.Setenv(EnvUser, "acme")
	t.Setenv(EnvPassword, canary)
	t.Setenv(EnvPrice, "4 USD/GB")
	ps, err := ProvidersFromEnv()
	require.NoError(t, err)
	require.Len(t, ps, 1, "one account: one provider")

	t.Setenv(EnvProvider+"_2", "oxylabs")
	t.Setenv(EnvUser+"_2", "acme2")
	t.Setenv(EnvPassword+"_2", canary+"2")
	t.Setenv(EnvGateway+"_2", "127.0.0.1:7777")
	t.Setenv(EnvPrice+"_2", "9.5 USD/GB")
	ps, err = ProvidersFromEnv()
	require.NoError(t, err)
	require.Len(t, ps, 2)
	require.Equal(t, "decodo", ps[0].Name())
	require.Equal(t, int64(4_000_000), ps[0].Price().MicrosPerGB)
	require.Equal(t, "oxylabs", ps[1].Name())
	require.Equal(t, "127.0.0.1:7777", ps[1].Gateway())
	require.Equal(t, int64(9_500_000), ps[1].Price().MicrosPerGB, "its own price")
	require.Equal(t, TierResidential, ps[1].Tier(), "residential unless set")
	t.Setenv(EnvTier+"_2", "Datacenter")
	ps, err = ProvidersFromEnv()
	require.NoError(t, err)
	require.Equal(t, TierDatacenter, ps[1].Tier())
	require.Equal(t, TierResidential, ps[0].Tier())
	t.Setenv(EnvTier+"_2", "satellite")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, "sessions: "+EnvTier+"_2: tier \"satellite\": want datacenter, residential or mobile")
	t.Setenv(EnvTier+"_2", "mobile")

	t.Setenv(EnvProvider+"_3", "decodo")
	t.Setenv(EnvUser+"_3", "acme3")
	t.Setenv(EnvPassword+"_3", canary)
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, EnvName+"_3")
	t.Setenv(EnvName+"_3", "decodo-backup")
	ps, err = ProvidersFromEnv()
	require.NoError(t, err)
	require.Equal(t, "decodo-backup", ps[2].Name())

	t.Setenv(EnvName+"_3", "Bad Name")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, EnvName+"_3")
	t.Setenv(EnvName+"_3", "decodo-backup")
	t.Setenv(EnvPrice+"_3", "cheap")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, "sessions: "+EnvPrice+"_3: price \"cheap\" is not")
	require.NotContains(t, err.Error(), "sessions: sessions:")
	t.Setenv(EnvPrice+"_3", "")
	t.Setenv(EnvPassword+"_3", "")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, EnvPassword+"_3")
	require.NotContains(t, err.Error(), canary)
	t.Setenv(EnvPassword+"_3", canary)

	t.Setenv(EnvProvider+"_10", "oxylabs")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, EnvProvider+"_10 is set: at most 9 accounts")
	t.Setenv(EnvProvider+"_10", "")

	t.Setenv(EnvProvider+"_2", "")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, EnvUser+"_2 is set but "+EnvProvider+"_2 is not", "an account half set")
	for _, v := range []string{EnvUser, EnvPassword, EnvGateway, EnvPrice, EnvTier} {
		t.Setenv(v+"_2", "")
	}
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, "without gaps")
	t.Setenv(EnvPassword+"_2_FILE", "/nonexistent")
	_, err = ProvidersFromEnv()
	require.ErrorContains(t, err, EnvPassword+"_2_FILE is set but "+EnvProvider+"_2 is not")
}

// TestRedactedForms: every way Go prints or encodes a Provider or Session hides the
// credentials, nested in other structs too.
func TestRedactedForms(t *testing.T) {
	p, err := Oxylabs("acme-user", canary)
	require.NoError(t, err)
	s, err := p.NewSession("US", time.Minute, time.Now())
	require.NoError(t, err)
	holder := struct {
		P *Provider
		S *Session
		V Session
		W Provider
	}{p, s, *s, *p}
	hidden := struct{ v Session }{*s} // unexported: fmt can not call its methods
	var out []string
	for _, v := range []any{p, s, *p, *s, holder, &holder, hidden} {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%d"} {
			out = append(out, fmt.Sprintf(verb, v))
		}
		b, err := json.Marshal(v)
		require.NoError(t, err)
		out = append(out, string(b))
	}
	var logs strings.Builder
	slog.New(slog.NewJSONHandler(&logs, nil)).Info("x", "provider", p, "session", s)
	slog.New(slog.NewTextHandler(&logs, nil)).Info("x", "provider", p, "session", s)
	out = append(out, logs.String())
	basic := base64.StdEncoding.EncodeToString([]byte("customer-acme-user"))
	for _, o := range out {
		require.NotContains(t, o, canary)
		require.NotContains(t, o, basic[:12], "base64 of the credentials")
		require.NotContains(t, o, "customer-acme-user-cc", "the session username carries the account")
	}
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Duration{
		"":                              0,
		"120":                           2 * time.Minute,
		" 7 ":                           7 * time.Second,
		"-5":                            0,
		"9999999999":                    24 * time.Hour, // capped, not overflowed
		"99999999999999999999":          0,              // not a number Go can hold: ignored
		"Thu, 23 Apr 2026 15:10:00 GMT": 10 * time.Minute,
		"Thu, 23 Apr 2026 14:00:00 GMT": 0,
		"soon":                          0,
	} {
		require.Equal(t, want, retryAfter(in, now), "Retry-After %q", in)
	}
}
