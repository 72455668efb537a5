package service_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/service"
)

// hostReq sends a request to the bundle's port on 127.0.0.1 under the given Host header
// and returns the status and body.
func (b *bundle) hostReq(t *testing.T, method, path, host string, headers map[string]string) (int, string) {
	t.Helper()
	_, port, err := net.SplitHostPort(b.svc.HTTPAddr())
	require.NoError(t, err)
	req, err := http.NewRequest(method, "http://127.0.0.1:"+port+path, nil)
	require.NoError(t, err)
	req.Host = host
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// hostRefused reads idemscrape_http_host_refused_total from /metrics.
func (b *bundle) hostRefused(t *testing.T) int {
	t.Helper()
	code, body := b.hostReq(t, "GET", "/metrics", "localhost", nil)
	require.Equal(t, http.StatusOK, code, body)
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "idemscrape_http_host_refused_total "); ok {
			n, err := strconv.ParseFloat(v, 64)
			require.NoError(t, err)
			return int(n)
		}
	}
	t.Fatalf("idemscrape_http_host_refused_total not on /metrics")
	return 0
}

// TestHostHeaderRefused: a request whose Host is neither the listen address, a loopback
// name nor a configured host (a DNS-rebinding page) gets 421 on the job pages and
// asynqmon, same-origin writes included; the refusals are counted; probes and the scraper
// are not checked.
func TestHostHeaderRefused(t *testing.T) {
	const rebind = "rebind.attacker.example"

	t.Run("Loopback", func(t *testing.T) {
		b := setup(t, setupOpts{writable: true, hosts: []string{"jobs.internal", "ops.example:8443"}})
		_, port, err := net.SplitHostPort(b.svc.HTTPAddr())
		require.NoError(t, err)
		require.Equal(t, 0, b.hostRefused(t))

		refused := 0
		for _, path := range []string{"/jobs", "/monitoring/api/queues", "/monitoring/", "/windows", "/jobs/x", "/"} {
			for _, host := range []string{rebind, rebind + ":" + port, "127.0.0.1.attacker.example", "localhost.attacker.example:" + port, "jobs.internal.evil"} {
				code, body := b.hostReq(t, "GET", path, host, nil)
				assert.Equal(t, http.StatusMisdirectedRequest, code, "%s under %s: %s", path, host, body)
				assert.Contains(t, body, "is not allowed", path)
				assert.Contains(t, body, strconv.Quote(host), "the answer names the Host")
				refused++
			}
		}

		// A same-origin write under the rebinding name (the page's own origin) never
		// reaches asynqmon: the queue stays running.
		b.probeTask(t)
		insp := asynq.NewInspector(b.opt)
		defer insp.Close()
		pause := func(host string) int {
			code, _ := b.hostReq(t, "POST", "/monitoring/api/queues/"+b.queue+":pause", host,
				map[string]string{"Sec-Fetch-Site": "same-origin", "Origin": "http://" + host})
			return code
		}
		assert.Equal(t, http.StatusMisdirectedRequest, pause(rebind+":"+port))
		refused++
		info, err := insp.GetQueueInfo(b.queue)
		require.NoError(t, err)
		assert.False(t, info.Paused, "a rebinding page paused the queue")

		// Accepted: the listen address, loopback names and IPs with any port or none, the
		// configured hosts (case and a trailing dot aside; a port given must match).
		for _, host := range []string{b.svc.HTTPAddr(), "127.0.0.1", "localhost", "localhost:" + port, "LocalHost.:1234",
			"127.0.0.2:9", "[::1]", "[::1]:" + port, "jobs.internal", "JOBS.internal.:80", "ops.example:8443"} {
			code, body := b.hostReq(t, "GET", "/jobs", host, nil)
			assert.Equal(t, http.StatusOK, code, "%s: %s", host, body)
		}
		for _, host := range []string{"ops.example", "ops.example:9999", "[::1"} {
			code, _ := b.hostReq(t, "GET", "/jobs", host, nil)
			assert.Equal(t, http.StatusMisdirectedRequest, code, "%q", host)
			refused++
		}
		assert.Equal(t, http.StatusNoContent, pause("localhost:"+port), "the same write under a loopback name")
		info, err = insp.GetQueueInfo(b.queue)
		require.NoError(t, err)
		assert.True(t, info.Paused)

		// Probes and the scraper reach the server by whatever address: not checked.
		for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
			code, body := b.hostReq(t, "GET", path, rebind, nil)
			assert.Equal(t, http.StatusOK, code, "%s: %s", path, body)
		}

		// A long Host is echoed in part only.
		long := strings.Repeat("a", 5000) + ".example"
		code, body := b.hostReq(t, "GET", "/jobs", long, nil)
		assert.Equal(t, http.StatusMisdirectedRequest, code)
		assert.Less(t, len(body), 400, "at most ~200 bytes of the Host are echoed")
		refused++

		assert.Equal(t, refused, b.hostRefused(t), "every refusal counted")
	})

	t.Run("ListenAddress", func(t *testing.T) {
		// Listening on every interface: the listen address as listened is accepted (with its
		// port or none), an interface's IP or a name is not unless configured.
		b := setup(t, setupOpts{httpAddr: "0.0.0.0:0", insecure: true, hosts: []string{"10.1.2.3"}})
		host, port, err := net.SplitHostPort(b.svc.HTTPAddr())
		require.NoError(t, err)
		for _, h := range []string{net.JoinHostPort(host, port), "10.1.2.3:" + port, "10.1.2.3"} {
			code, body := b.hostReq(t, "GET", "/jobs", h, nil)
			assert.Equal(t, http.StatusOK, code, "%s: %s", h, body)
		}
		for _, h := range []string{net.JoinHostPort(host, "1"), "10.1.2.4:" + port, rebind} {
			code, _ := b.hostReq(t, "GET", "/jobs", h, nil)
			assert.Equal(t, http.StatusMisdirectedRequest, code, h)
		}
	})

	t.Run("BadEntries", func(t *testing.T) {
		b := setup(t, setupOpts{noDisp: true})
		for _, h := range []string{"", "http://jobs.internal", "jobs.internal/x", "*.internal", "a b", "jobs.internal:0", "jobs.internal:x", "[::1"} {
			c := b.validConfig(t)
			c.AllowedHosts = []string{h}
			_, err := service.New(c)
			assert.ErrorContains(t, err, "Config.AllowedHosts entry", "%q", h)
		}
		assert.NoError(t, service.CheckAllowedHosts([]string{"jobs.internal", "10.0.0.1:8080", "[fd00::1]:8080", "fd00::2"}))
	})
}
