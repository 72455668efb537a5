package job_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/job"
)

func TestDestinationPolicy(t *testing.T) {
	t.Parallel()
	strict := job.StrictDestinationPolicy()
	loop := job.LoopbackPolicy()
	custom := &job.DestinationPolicy{Ports: []uint16{443, 9443}}
	loopPorts := job.LoopbackPolicy()
	loopPorts.AnyPortOnAllowed = false

	tests := []struct {
		name    string
		policy  *job.DestinationPolicy
		in      string
		allowed bool
		inErr   string // part of the error's text when refused
	}{
		// Public destinations on the default ports.
		{"PublicHTTPS", strict, "https://shop.example.com/p/1", true, ""},
		{"PublicHTTP", strict, "http://shop.example.com/", true, ""},
		{"Port8080", strict, "http://shop.example.com:8080/", true, ""},
		{"Port8443", strict, "https://shop.example.com:8443/", true, ""},
		{"ExplicitDefaultPort", strict, "https://shop.example.com:443/", true, ""},
		{"PublicIPv4", strict, "http://93.184.215.14/", true, ""},
		{"PublicIPv6", strict, "http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/", true, ""},
		// Ports.
		{"RedisPort", strict, "http://example.com:6379/", false, "port 6379"},
		{"SSHPort", strict, "https://example.com:22/", false, "port 22"},
		{"HTTPSOnPort80IsPort80", strict, "https://example.com:80/", true, ""},
		{"HTTPOn443IsPort443", strict, "http://example.com:443/", true, ""},
		{"CustomPortsAllow9443", custom, "https://example.com:9443/", true, ""},
		{"CustomPortsRefuse80", custom, "http://example.com/", false, "port 80"},
		// Loopback in every spelling.
		{"Loopback", strict, "http://127.0.0.1/", false, "loopback"},
		{"LoopbackOtherHost", strict, "http://127.8.9.10/", false, "loopback"},
		{"LoopbackShort", strict, "http://127.1/", false, "loopback"},
		{"LoopbackDecimal", strict, "http://2130706433/", false, "loopback"},
		{"LoopbackHex", strict, "http://0x7f000001/", false, "loopback"},
		{"LoopbackOctal", strict, "http://0177.0.0.1/", false, "loopback"},
		{"LoopbackHexDotted", strict, "http://0x7f.0.0.1/", false, "loopback"},
		{"LoopbackOctalShort", strict, "http://017700000001/", false, "loopback"},
		{"LoopbackTrailingDot", strict, "http://127.0.0.1./", false, "loopback"},
		{"LoopbackIPv6", strict, "http://[::1]/", false, "loopback"},
		{"LoopbackIPv6Long", strict, "http://[0:0:0:0:0:0:0:1]/", false, "loopback"},
		{"IPv4MappedLoopback", strict, "http://[::ffff:127.0.0.1]/", false, "loopback"},
		{"IPv4MappedLoopbackHex", strict, "http://[::ffff:7f00:1]/", false, "loopback"},
		{"IPv4CompatiblePrivate", strict, "http://[::10.0.0.1]/", false, "private"},
		{"NAT64Private", strict, "http://[64:ff9b::a00:1]/", false, "private"},
		{"SixToFourPrivate", strict, "http://[2002:c0a8:101::1]/", false, "private"},
		{"Localhost", strict, "http://localhost/", false, "localhost"},
		{"LocalhostUpperTrailingDot", strict, "http://LOCALHOST./", false, "localhost"},
		{"SubdomainOfLocalhost", strict, "http://api.localhost:8080/", false, "localhost"},
		// Private, link-local, metadata, CGNAT, multicast, unspecified.
		{"Private10", strict, "http://10.0.0.1/", false, "private"},
		{"Private172", strict, "http://172.16.5.4/", false, "private"},
		{"Private192Decimal", strict, "http://3232235521/", false, "private"}, // 192.168.0.1
		{"ULA", strict, "http://[fd00::1]/", false, "private"},
		{"AWSMetadata", strict, "http://169.254.169.254/latest/meta-data/", false, "link-local"},
		{"AWSMetadataDecimal", strict, "http://2852039166/", false, "link-local"},
		{"AWSMetadataIPv6", strict, "http://[fd00:ec2::254]/", false, "private"},
		{"GCPMetadataName", strict, "http://metadata.google.internal/computeMetadata/v1/", false, "metadata"},
		{"AlibabaMetadataCGNAT", strict, "http://100.100.100.200/", false, "100.64.0.0/10"},
		{"CGNAT", strict, "http://100.64.0.1/", false, "100.64.0.0/10"},
		{"LinkLocalIPv6", strict, "http://[fe80::1]/", false, "link-local"},
		{"Multicast", strict, "http://224.0.0.1/", false, "multicast"},
		{"MulticastIPv6", strict, "http://[ff02::1]/", false, "multicast"},
		{"Unspecified", strict, "http://0.0.0.0/", false, "unspecified"},
		{"UnspecifiedShort", strict, "http://0/", false, "unspecified"},
		{"UnspecifiedIPv6", strict, "http://[::]/", false, "unspecified"},
		{"Broadcast", strict, "http://255.255.255.255/", false, "240.0.0.0/4"},
		// Credentials are never echoed.
		{"CredentialsNotEchoed", strict, "http://admin:hunter2@127.0.0.1/", false, "loopback"},
		// The loopback relaxation: loopback on any port, nothing else.
		{"LoopbackPolicyLoopback", loop, "http://127.0.0.1:39127/", true, ""},
		{"LoopbackPolicyDecimal", loop, "http://2130706433:8080/", true, ""},
		{"LoopbackPolicyIPv6", loop, "http://[::1]:1234/", true, ""},
		{"LoopbackPolicyLocalhost", loop, "http://localhost:5000/", true, ""},
		{"LoopbackPolicyPrivate", loop, "http://10.0.0.1/", false, "private"},
		{"LoopbackPolicyMetadata", loop, "http://169.254.169.254/", false, "link-local"},
		{"LoopbackPolicyPublicPort", loop, "http://example.com:6379/", false, "port 6379"},
		// Allowing an address range does not by itself allow every port.
		{"AllowedRangeKeepsPorts", loopPorts, "http://127.0.0.1:6379/", false, "port 6379"},
		{"AllowedRangeAllowedPort", loopPorts, "http://127.0.0.1:8080/", true, ""},
		{"AllowedLocalhostKeepsPorts", loopPorts, "http://localhost:6379/", false, "port 6379"},
		// Not a web URL at all.
		{"Scheme", strict, "ftp://example.com/", false, "scheme"},
	}
	require.GreaterOrEqual(t, len(tests), 20)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := tt.policy.CheckURL(tt.in)
			if tt.allowed {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			var fe *job.FieldError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, "URL", fe.Field)
			assert.ErrorIs(t, err, job.ErrInvalidSpec)
			assert.Contains(t, err.Error(), tt.inErr)
			assert.NotContains(t, err.Error(), "hunter2")
			assert.NotContains(t, err.Error(), "admin")
		})
	}

	t.Run("KeyStaysPure", func(t *testing.T) {
		t.Parallel()
		// Normalisation and keys do not apply the policy: only the Enqueuer and the guard do.
		s := job.Spec{Kind: "catalog", URL: "http://127.0.0.1:6379/", Country: "US", Window: "w", ParserVersion: 1}
		_, err := s.Key()
		assert.NoError(t, err)
	})

	t.Run("CheckAddr", func(t *testing.T) {
		t.Parallel()
		assert.NoError(t, strict.CheckAddr(netip.MustParseAddr("93.184.215.14")))
		assert.ErrorContains(t, strict.CheckAddr(netip.MustParseAddr("::ffff:192.168.1.1")), "private")
		assert.NoError(t, loop.CheckAddr(netip.MustParseAddr("127.0.0.1")))
		assert.ErrorContains(t, loop.CheckAddr(netip.MustParseAddr("192.168.1.1")), "private")
	})

	t.Run("Validate", func(t *testing.T) {
		t.Parallel()
		assert.ErrorContains(t, (&job.DestinationPolicy{Ports: []uint16{0}}).Validate(), "Ports")
		assert.ErrorContains(t, (&job.DestinationPolicy{Allow: []netip.Prefix{{}}}).Validate(), "Allow[0]")
		assert.NoError(t, strict.Validate())
	})
}
