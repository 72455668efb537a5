package testutil

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestCA is a certificate authority of a test's own, with a server certificate it signed
// for 127.0.0.1 and localhost, all as PEM files in the test's temporary directory.
type TestCA struct {
	CAFile            string // the CA's certificate
	CertFile, KeyFile string // the server's certificate and key (127.0.0.1, ::1, localhost)
	ClientCertFile    string // a client certificate the CA signed
	ClientKeyFile     string
	OtherCAFile       string // another CA's certificate, which signed nothing here
}

// NewTestCA generates a CA, a server and a client certificate (ECDSA P-256, valid for a
// day) with crypto/x509.
func NewTestCA(t testing.TB) *TestCA {
	t.Helper()
	dir := t.TempDir()
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatalf("testutil: write %s: %v", name, err)
		}
		return p
	}
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatalf("testutil: key: %v", err)
		}
		return k
	}
	serial := int64(1)
	template := func(cn string) *x509.Certificate {
		serial++
		return &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	}
	makeCA := func(cn string) (*x509.Certificate, *ecdsa.PrivateKey, []byte) {
		k := newKey()
		tmpl := template(cn)
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
		if err != nil {
			t.Fatalf("testutil: CA certificate: %v", err)
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatalf("testutil: parse CA: %v", err)
		}
		return c, k, der
	}
	ca, caKey, caDER := makeCA("idemscrape test CA")
	_, _, otherDER := makeCA("another test CA")
	leaf := func(cn string, usage x509.ExtKeyUsage, server bool) ([]byte, []byte) {
		k := newKey()
		tmpl := template(cn)
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{usage}
		if server {
			tmpl.DNSNames = []string{"localhost"}
			tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatalf("testutil: certificate %s: %v", cn, err)
		}
		kd, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatalf("testutil: key %s: %v", cn, err)
		}
		return der, kd
	}
	srvDER, srvKey := leaf("localhost", x509.ExtKeyUsageServerAuth, true)
	cliDER, cliKey := leaf("idemscrape client", x509.ExtKeyUsageClientAuth, false)
	return &TestCA{
		CAFile:         write("ca.pem", "CERTIFICATE", caDER),
		CertFile:       write("server.pem", "CERTIFICATE", srvDER),
		KeyFile:        write("server-key.pem", "EC PRIVATE KEY", srvKey),
		ClientCertFile: write("client.pem", "CERTIFICATE", cliDER),
		ClientKeyFile:  write("client-key.pem", "EC PRIVATE KEY", cliKey),
		OtherCAFile:    write("other-ca.pem", "CERTIFICATE", otherDER),
	}
}
