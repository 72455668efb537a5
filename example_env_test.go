package idemscrape_test

import (
	"bytes"
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"log"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestMain fails the package's tests if a goroutine they started outlives them.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const canary = "pw-frontdoor-canary-91c4"

// TestExample runs the README's front-door example (Example) as a user's program runs: the
// environment names a fresh PostgreSQL database, a throwaway redis-server, a shop and a
// residential proxy; the example registers its kind, enqueues one job twice, runs the
// worker and consumes the event. Its output is checked, then what it left is checked from
// outside: the rows in PostgreSQL, the stream in Redis, the requests at the shop and the
// proxy, and no trace of the proxy password anywhere.
func TestExample(t *testing.T) {
	pg := testutil.PG(t)
	rs := testutil.StartRedis(t)
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 44})
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 44, Format: testutil.ProxyFormatDecodo, User: "acct", Password: canary})
	cc := pg.Config().ConnConfig
	t.Setenv("DATABASE_URL", fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", cc.User, cc.Host+":"+strconv.Itoa(int(cc.Port)), cc.Database))
	t.Setenv("REDIS_ADDR", rs.Addr)
	t.Setenv("HTTP_ADDR", "127.0.0.1:0")
	t.Setenv("SHOP_URL", site.URL)
	t.Setenv("SHOP_ON_LOOPBACK", "1")
	t.Setenv("IDEMSCRAPE_PROXY_PROVIDER", "decodo")
	t.Setenv("IDEMSCRAPE_PROXY_USER", "acct")
	t.Setenv("IDEMSCRAPE_PROXY_PASSWORD", canary)
	t.Setenv("IDEMSCRAPE_PROXY_GATEWAY", proxy.Addr)

	out, logs := captureOutput(t, Example)
	want, ok := site.Product("sku-1")
	require.True(t, ok)
	assert.Equal(t, "enqueue: created\nenqueue: already_queued\nevent: product-name "+want.Name+"\n", out)

	ctx := context.Background()
	assert.Equal(t, 1, testutil.Count(t, pg, `SELECT count(*) FROM jobs WHERE state = 'complete'`))
	assert.Equal(t, 1, testutil.Count(t, pg, `SELECT count(*) FROM jobs`))
	assert.Equal(t, 1, testutil.Count(t, pg, `SELECT count(*) FROM results WHERE data->>'name' = $1`, want.Name))
	assert.Equal(t, 1, testutil.Count(t, pg, `SELECT count(*) FROM outbox`))
	rdb := rs.Client()
	info, err := rdb.XInfoStream(ctx, outbox.StreamKey(outbox.DefaultPrefix, "product-name")).Result()
	require.NoError(t, err)
	assert.Equal(t, int64(1), info.EntriesAdded, "one event published on the kind's stream (the dispatcher trims it once consumed)")
	assert.Equal(t, 1, site.Hits("/product/sku-1"))
	assert.Equal(t, 1, site.Hits("/search"))
	assert.Positive(t, proxy.Requests())

	for _, table := range []string{"jobs", "attempts", "results", "outbox"} {
		for _, row := range testutil.TableSnapshot(t, pg, table) {
			assert.NotContains(t, row, canary, table)
		}
	}
	assert.NotContains(t, logs, canary, "the example's logs")
}

// captureOutput runs f with os.Stdout and os.Stderr (and so the default logger) going to
// pipes, and returns what f printed to each.
func captureOutput(t *testing.T, f func()) (stdout, stderr string) {
	t.Helper()
	read := func(r *os.File, into *bytes.Buffer, done chan<- struct{}) {
		_, _ = io.Copy(into, r)
		close(done)
	}
	or, ow, err := os.Pipe()
	require.NoError(t, err)
	er, ew, err := os.Pipe()
	require.NoError(t, err)
	var ob, eb bytes.Buffer
	od, ed := make(chan struct{}), make(chan struct{})
	go read(or, &ob, od)
	go read(er, &eb, ed)
	oldOut, oldErr := os.Stdout, os.Stderr
	os.Stdout, os.Stderr = ow, ew
	log.SetOutput(ew) // the default logger (and slog's default) captured os.Stderr at init
	defer func() {
		os.Stdout, os.Stderr = oldOut, oldErr
		log.SetOutput(oldErr)
		_ = ow.Close()
		_ = ew.Close()
		<-od
		<-ed
		stdout, stderr = ob.String(), eb.String()
		t.Logf("the example's log:\n%s", stderr)
	}()
	f()
	return
}

// TestExampleIdentifiers counts what the front-door example needs of the project: at most
// two project imports, and the package-qualified identifiers it names.
func TestExampleIdentifiers(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "example_test.go", nil, 0)
	require.NoError(t, err)
	const module = "github.com/idemscrape/idemscrape"
	local := map[string]bool{}
	var imports []string
	for _, im := range f.Imports {
		p, _ := strconv.Unquote(im.Path.Value)
		if p == module || strings.HasPrefix(p, module+"/") {
			imports = append(imports, p)
			name := p[strings.LastIndex(p, "/")+1:]
			if im.Name != nil {
				name = im.Name.Name
			}
			local[name] = true
		}
	}
	assert.LessOrEqual(t, len(imports), 2, "project imports: %v", imports)
	seen := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok && local[id.Name] {
				seen[id.Name+"."+sel.Sel.Name] = true
			}
		}
		return true
	})
	var names []string
	for n := range seen {
		names = append(names, n)
	}
	sort.Strings(names)
	t.Logf("%d project identifiers: %s", len(names), strings.Join(names, " "))
	assert.LessOrEqual(t, len(names), 12, "the front door should take about 11 identifiers: %v", names)
}

// TestReadmeHasExample: the README's front-door example is Example's body, byte for byte,
// so the code a reader copies is the code CI runs.
func TestReadmeHasExample(t *testing.T) {
	src, err := os.ReadFile("example_test.go")
	require.NoError(t, err)
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	s := string(src)
	start := strings.Index(s, "func Example() {\n")
	require.GreaterOrEqual(t, start, 0)
	body := strings.TrimRight(s[start+len("func Example() {\n"):strings.LastIndex(s, "}")], "\n")
	assert.Contains(t, string(readme), body, "README.md must hold Example's body from example_test.go")
}
