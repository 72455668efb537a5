package envflag

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
)

// Test secrets: none of them may appear in an error or a log line.
const (
	pfPassBD   = "bd-pass-never-shown-31"
	pfPassOxy  = "oxy-pass-never-shown-77"
	pfPassIPR  = "ipr-pass-never-shown-05"
	pfUserOxy  = "oxyuser-from-env-42"
	pfUserFile = "soaxpkg-from-file-9"
)

var pfSecrets = []string{pfPassBD, pfPassOxy, pfPassIPR, pfUserOxy, pfUserFile}

// clearProxyEnv unsets every variable sessions.ProvidersFromEnv and Providers read (restored
// when the test ends).
func clearProxyEnv(t *testing.T) {
	t.Helper()
	for _, name := range append(proxyVariables(), EnvProvidersFile) {
		t.Setenv(name, "")
		require.NoError(t, os.Unsetenv(name))
	}
}

// providerState is everything a provider holds, its credentials included (read through
// the unexported fields: sessions offers no accessor for them, on purpose).
func providerState(t *testing.T, p *sessions.Provider) (fields map[string]any, user, pass string) {
	t.Helper()
	v := reflect.ValueOf(p).Elem()
	fields = map[string]any{}
	for i := range v.NumField() {
		f := v.Field(i)
		f = reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem()
		if f.Kind() == reflect.Func {
			out := f.Call(nil)
			user, pass = out[0].String(), out[1].String()
			continue
		}
		fields[v.Type().Field(i).Name] = f.Interface()
	}
	return fields, user, pass
}

func writePF(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

// TestProvidersFile: a providers file makes the same providers, in the same order, as the
// equivalent IDEMSCRAPE_PROXY_* variables (credentials from the environment and from
// files; gateway, name, tier, price per country; priority orders them); every bad field is
// refused with an error naming the file's line and the field; a file and the variables
// together are refused; and no user or password ever appears in an error or a log line.
func TestProvidersFile(t *testing.T) {
	clearProxyEnv(t)
	dir := t.TempDir()
	secrets := filepath.Join(dir, "secrets")
	require.NoError(t, os.Mkdir(secrets, 0o700))
	writePF(t, secrets, "oxy", pfPassOxy+"\n")
	writePF(t, secrets, "soax-user", pfUserFile+"\n")
	const valid = `# three accounts; the order is the priority's
providers:
  - name: bd-dc
    format: brightdata
    zone: dc_zone1
    user: hl_1234
    password_env: PF_BD_PASS
    tier: datacenter
    price: 0.60 USD/GB
    priority: 2
  - format: oxylabs
    gateway: 127.0.0.1:7777
    user_env: PF_OXY_USER
    password_file: secrets/oxy
    price: 8.40 USD/GB
    price_countries: {de: 9.10, BR: "12 USD/GB"}
    priority: 1
  - name: iproyal-mobile
    format: iproyal
    user_file: secrets/soax-user
    password_env: PF_IPR_PASS
    tier: mobile
    priority: 3
`
	file := writePF(t, dir, "providers.yaml", valid)
	t.Setenv("PF_BD_PASS", pfPassBD)
	t.Setenv("PF_OXY_USER", pfUserOxy)
	t.Setenv("PF_IPR_PASS", pfPassIPR)

	t.Run("SameAsTheVariables", func(t *testing.T) {
		fromFile, err := Providers(file)
		require.NoError(t, err)

		// The same accounts through the numbered variables, in the priority's order.
		for name, v := range map[string]string{
			"IDEMSCRAPE_PROXY_PROVIDER": "oxylabs", "IDEMSCRAPE_PROXY_USER": pfUserOxy,
			"IDEMSCRAPE_PROXY_PASSWORD_FILE": filepath.Join(secrets, "oxy"), "IDEMSCRAPE_PROXY_GATEWAY": "127.0.0.1:7777",
			"IDEMSCRAPE_PROXY_PRICE": "8.40 USD/GB", "IDEMSCRAPE_PROXY_PRICE_COUNTRIES": "DE=9.10,BR=12",
			"IDEMSCRAPE_PROXY_PROVIDER_2": "brightdata", "IDEMSCRAPE_PROXY_USER_2": "hl_1234", "IDEMSCRAPE_PROXY_ZONE_2": "dc_zone1",
			"IDEMSCRAPE_PROXY_PASSWORD_2": pfPassBD, "IDEMSCRAPE_PROXY_NAME_2": "bd-dc", "IDEMSCRAPE_PROXY_TIER_2": "datacenter",
			"IDEMSCRAPE_PROXY_PRICE_2":    "0.60 USD/GB",
			"IDEMSCRAPE_PROXY_PROVIDER_3": "iproyal", "IDEMSCRAPE_PROXY_USER_3": pfUserFile, "IDEMSCRAPE_PROXY_PASSWORD_3": pfPassIPR,
			"IDEMSCRAPE_PROXY_NAME_3": "iproyal-mobile", "IDEMSCRAPE_PROXY_TIER_3": "mobile",
		} {
			t.Setenv(name, v)
		}
		fromEnv, err := Providers("")
		require.NoError(t, err)
		require.Len(t, fromFile, 3)
		require.Len(t, fromEnv, 3)
		for i := range fromEnv {
			ff, fu, fp := providerState(t, fromFile[i])
			ef, eu, ep := providerState(t, fromEnv[i])
			assert.Equal(t, ef, ff, "provider %d (%s)", i+1, fromEnv[i].Name())
			assert.True(t, fu == eu && fp == ep, "provider %d: the same credentials", i+1)
		}
		assert.Equal(t, []string{"oxylabs", "bd-dc", "iproyal-mobile"}, []string{fromFile[0].Name(), fromFile[1].Name(), fromFile[2].Name()})
		assert.Equal(t, map[string]int64{"DE": 9_100_000, "BR": 12_000_000}, fromFile[0].Price().ByCountry)

		// Both ways at once: refused, naming the variables (the file's own excepted).
		_, err = Providers(file)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "$IDEMSCRAPE_PROXY_PROVIDER, ")
		assert.Contains(t, err.Error(), "$IDEMSCRAPE_PROXY_PROVIDER_3")
		assert.Contains(t, err.Error(), "are both set: configure the proxy accounts one way")
		assertNoSecret(t, err.Error())
	})

	t.Run("TheFileOwnVariablesAreNoConflict", func(t *testing.T) {
		clearProxyEnv(t)
		t.Setenv("PF_OXY_USER", pfUserOxy)
		t.Setenv("IDEMSCRAPE_PROXY_PASSWORD", pfPassBD)
		f := writePF(t, dir, "own.yaml", "providers:\n  - format: oxylabs\n    user_env: PF_OXY_USER\n    password_env: IDEMSCRAPE_PROXY_PASSWORD\n")
		ps, err := Providers(f)
		require.NoError(t, err)
		require.Len(t, ps, 1)
		_, u, p := providerState(t, ps[0])
		assert.True(t, u == pfUserOxy && p == pfPassBD)
		t.Setenv("IDEMSCRAPE_PROXY_PRICE_2", "1 USD/GB")
		_, err = Providers(f)
		assert.ErrorContains(t, err, "$IDEMSCRAPE_PROXY_PRICE_2 are both set")
	})

	t.Run("BadFields", func(t *testing.T) {
		clearProxyEnv(t)
		t.Setenv("PF_BD_PASS", pfPassBD)
		t.Setenv("PF_OXY_USER", pfUserOxy)
		t.Setenv("PF_EMPTY", "")
		writePF(t, dir, "empty-secret", "\n")
		// ok is a valid account, indented as an item of providers.
		const ok = "  - format: oxylabs\n    user_env: PF_OXY_USER\n    password_env: PF_BD_PASS\n"
		for name, tc := range map[string]struct {
			yaml  string
			line  int
			field string
			want  string
		}{
			"NotYAML":          {"providers:\n  - format: oxylabs\n\tuser: u1\n", 2, "", "not YAML"},
			"Empty":            {"# nothing\n", 0, "", "empty"},
			"TopLevelUnknown":  {"provider:\n" + ok, 1, "provider", "unknown field"},
			"ProvidersMissing": {"{}\n", 1, "providers", "missing"},
			"ProvidersNotList": {"providers: oxylabs\n", 1, "providers", "want a list"},
			"ProvidersEmpty":   {"providers: []\n", 1, "providers", "empty"},
			"EntryNotMapping":  {"providers:\n  - oxylabs\n", 2, "", "want a mapping"},
			"UnknownField":     {"providers:\n" + ok + "    gatewy: a:1\n", 5, "gatewy", "unknown field"},
			"InlinePassword":   {"providers:\n  - format: oxylabs\n    user: u1\n    password: " + pfPassOxy + "\n", 4, "password", "never written in the providers file"},
			"FieldTwice":       {"providers:\n" + ok + "    format: decodo\n", 5, "format", "given twice"},
			"FieldEmpty":       {"providers:\n" + ok + "    gateway:\n", 5, "gateway", "empty"},
			"FieldList":        {"providers:\n" + ok + "    tier: [mobile]\n", 5, "tier", "single value"},
			"FormatMissing":    {"providers:\n  - user: u1\n    password_env: PF_BD_PASS\n", 2, "format", "missing"},
			"FormatUnknown":    {"providers:\n  - format: luminati\n    user: u1\n    password_env: PF_BD_PASS\n", 2, "format", `"luminati": want one of`},
			"ZoneMissing":      {"providers:\n  - format: brightdata\n    user: u1\n    password_env: PF_BD_PASS\n", 2, "zone", "needs its zone"},
			"ZoneNotBD":        {"providers:\n" + ok + "    zone: z1\n", 5, "zone", "only a brightdata"},
			"ZoneBad":          {"providers:\n  - format: brightdata\n    zone: z 1\n    user: u1\n    password_env: PF_BD_PASS\n", 3, "zone", "want letters"},
			"UserMissing":      {"providers:\n  - format: oxylabs\n    password_env: PF_BD_PASS\n", 2, "user | user_env | user_file", "missing"},
			"UserTwice":        {"providers:\n" + ok + "    user: u2\n", 3, "user_env", "one way"},
			"UserColon":        {"providers:\n  - format: oxylabs\n    user: " + pfUserOxy + ":x\n    password_env: PF_BD_PASS\n", 3, "user", "contains ':'"},
			"UserRefused":      {"providers:\n  - format: brightdata\n    zone: z1\n    user: " + pfUserOxy + "!\n    password_env: PF_BD_PASS\n", 4, "user", "refused by the brightdata format"},
			"PasswordMissing":  {"providers:\n  - format: oxylabs\n    user: u1\n", 2, "password_env | password_file", "missing"},
			"PasswordTwice":    {"providers:\n" + ok + "    password_file: secrets/oxy\n", 5, "password_file", "one way"},
			"PasswordEnvUnset": {"providers:\n  - format: oxylabs\n    user: u1\n    password_env: PF_NOT_SET\n", 4, "password_env", "not set"},
			"PasswordEnvEmpty": {"providers:\n  - format: oxylabs\n    user: u1\n    password_env: PF_EMPTY\n", 4, "password_env", "not set"},
			// The secret itself where its variable's name belongs: refused, not shown.
			"PasswordEnvValue": {"providers:\n  - format: oxylabs\n    user: u1\n    password_env: " + pfPassOxy + "\n", 4, "password_env", "not the name of an environment variable"},
			"PasswordFileNone": {"providers:\n  - format: oxylabs\n    user: u1\n    password_file: " + pfPassIPR + "\n", 4, "password_file", "no such file"},
			"PasswordFileZero": {"providers:\n  - format: oxylabs\n    user: u1\n    password_file: empty-secret\n", 4, "password_file", "is empty"},
			"Gateway":          {"providers:\n" + ok + "    gateway: u1:" + pfPassOxy + "@proxy.example:1\n", 5, "gateway", "want host:port"},
			"NameBad":          {"providers:\n  - name: Oxy Labs\n    format: oxylabs\n    user: u1\n    password_env: PF_BD_PASS\n", 2, "name", "lower-case"},
			"NameTwice":        {"providers:\n" + ok + ok, 5, "format", "also provider 1's (line 2)"},
			"TierBad":          {"providers:\n" + ok + "    tier: premium\n", 5, "tier", `"premium": want datacenter, residential or mobile`},
			"PriceBad":         {"providers:\n" + ok + "    price: 8,40 USD\n", 5, "price", "<amount> <CUR>/GB"},
			"CountriesNoPrice": {"providers:\n" + ok + "    price_countries: {DE: 9}\n", 5, "price_countries", "needs price"},
			"CountriesNotMap":  {"providers:\n" + ok + "    price: 8 USD/GB\n    price_countries: DE=9\n", 6, "price_countries", "want a mapping"},
			"CountryBad":       {"providers:\n" + ok + "    price: 8 USD/GB\n    price_countries:\n      DEU: 9\n", 7, "price_countries.DEU", "not a country code"},
			"CountryTwice":     {"providers:\n" + ok + "    price: 8 USD/GB\n    price_countries:\n      DE: 9\n      de: 10\n", 8, "price_countries.de", "given twice (line 7)"},
			"CountryAmount":    {"providers:\n" + ok + "    price: 8 USD/GB\n    price_countries:\n      DE: nine\n", 7, "price_countries.DE", `"nine": want an amount`},
			"CountryCurrency":  {"providers:\n" + ok + "    price: 8 USD/GB\n    price_countries:\n      DE: 9 EUR/GB\n", 7, "price_countries.DE", "one currency per account"},
			"PriorityBad":      {"providers:\n" + ok + "    priority: first\n", 5, "priority", "whole number"},
			"PriorityZero":     {"providers:\n" + ok + "    priority: 0\n", 5, "priority", "whole number"},
			"PriorityTwice":    {"providers:\n" + ok + "    priority: 1\n  - name: two\n    " + ok[4:] + "    priority: 1\n", 10, "priority", "also provider 1's (line 5)"},
			"PriorityMixed":    {"providers:\n" + ok + "    priority: 1\n  - name: two\n    " + ok[4:], 6, "priority", "on every account or on none"},
		} {
			t.Run(name, func(t *testing.T) {
				f := writePF(t, dir, name+".yaml", tc.yaml)
				_, err := Providers(f)
				require.Error(t, err)
				var pe *ProvidersFileError
				require.ErrorAs(t, err, &pe, err.Error())
				assert.Equal(t, tc.line, pe.Line, err.Error())
				assert.Equal(t, tc.field, pe.Field, err.Error())
				assert.Contains(t, pe.Reason, tc.want)
				assert.True(t, strings.HasPrefix(err.Error(), "providers file "+f+": "), err.Error())
				if tc.line > 0 {
					assert.Contains(t, err.Error(), fmt.Sprintf(": line %d: ", tc.line))
				}
				if tc.field != "" {
					assert.Contains(t, err.Error(), "field "+tc.field+": ")
				}
				assertNoSecret(t, err.Error())
				t.Log(err)
			})
		}
		_, err := Providers(filepath.Join(dir, "missing.yaml"))
		assert.EqualError(t, err, "providers file "+filepath.Join(dir, "missing.yaml")+": no such file or directory")
	})

	t.Run("TheExample", func(t *testing.T) {
		env := map[string]string{"OXYLABS_PASSWORD": pfPassOxy, "DECODO_USER": pfUserOxy, "DECODO_PASSWORD": pfPassIPR}
		lookup := func(name string) (string, bool) { v, ok := env[name]; return v, ok }
		read := func(path string) (string, error) {
			require.Equal(t, "/run/secrets/brightdata-datacenter1", path)
			return pfPassBD, nil
		}
		ps, refs, err := loadProviders(filepath.Join("..", "..", "..", "examples", "providers.yaml"), lookup, read)
		require.NoError(t, err)
		var names []string
		for _, p := range ps {
			names = append(names, fmt.Sprintf("%s %s %s %s", p.Name(), p.Gateway(), p.Tier(), p.Price()))
		}
		assert.Equal(t, []string{
			"oxylabs-main pr.oxylabs.io:7777 residential 8.4 USD/GB",
			"brightdata-dc brd.superproxy.io:33335 datacenter 0.6 USD/GB",
			"decodo-backup gate.decodo.com:10001 residential 6 USD/GB",
		}, names)
		assert.Equal(t, map[string]int64{"DE": 9_100_000, "BR": 12_000_000}, ps[0].Price().ByCountry)
		assert.Equal(t, map[string]bool{"OXYLABS_PASSWORD": true, "DECODO_USER": true, "DECODO_PASSWORD": true}, refs)
	})

	t.Run("NoSecretInLogs", func(t *testing.T) {
		clearProxyEnv(t)
		t.Setenv("PF_BD_PASS", pfPassBD)
		t.Setenv("PF_OXY_USER", pfUserOxy)
		t.Setenv("PF_IPR_PASS", pfPassIPR)
		ps, err := Providers(file)
		require.NoError(t, err)
		var out bytes.Buffer
		for _, format := range []string{"text", "json"} {
			Log{Format: format, Level: "debug"}.Logger(&out).Info("providers", "proxies", ps, "first", ps[0])
		}
		for _, p := range ps {
			fmt.Fprintf(&out, "%v %+v %#v %s\n", p, p, p, p)
			b, err := json.Marshal(p)
			require.NoError(t, err)
			out.Write(b)
		}
		slog.New(slog.NewTextHandler(&out, nil)).Info("x", "p", ps[1])
		assert.Contains(t, out.String(), "bd-dc")
		assertNoSecret(t, out.String())
	})
}

func assertNoSecret(t *testing.T, s string) {
	t.Helper()
	for _, secret := range pfSecrets {
		assert.NotContains(t, s, secret)
	}
}
