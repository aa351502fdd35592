package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

func TestUnreachableEndpoint(t *testing.T) {
	t.Parallel()
	// Nothing listens on port 1: a port just released could be taken
	// again by a test running in parallel (ports picked with :0 come from
	// the ephemeral range, far above). A listener that accepts and never
	// answers is what a hung etcd or a blackholing firewall looks like.
	const closed = "127.0.0.1:1"
	if c, err := net.DialTimeout("tcp", closed, time.Second); err == nil {
		c.Close()
		t.Fatalf("something listens on %s", closed)
	}
	silent := newSilentListener(t)

	const dialTimeout = 500 * time.Millisecond
	for _, tc := range []struct{ name, endpoint string }{
		{"nothing listens", closed},
		{"the endpoint never answers", silent},
		{"the endpoint never answers TLS", "https://" + silent},
	} {
		for _, cmd := range [][]string{{"hosts"}, {"watch"}, {"leader", "/e/x"}, {"campaign", "/e/x", "me"}, {"hosts", "--user", "root:pw"}} {
			t.Run(tc.name+"/"+strings.Join(cmd, " "), func(t *testing.T) {
				t.Parallel()
				args := append([]string{"--endpoints", tc.endpoint, "--dial-timeout", dialTimeout.String()}, cmd...)
				r := runCoord(t, args...)
				if r.code != exitError {
					t.Errorf("status %d, want %d; stderr %q", r.code, exitError, r.stderr)
				}
				if !strings.Contains(r.stderr, "etcd at "+tc.endpoint) {
					t.Errorf("stderr %q does not name the endpoint %s", r.stderr, tc.endpoint)
				}
				// The dial timeout, plus room for a loaded machine.
				if r.took > dialTimeout+1500*time.Millisecond*scale {
					t.Errorf("took %v with --dial-timeout %v", r.took, dialTimeout)
				}
			})
		}
	}
}

// newSilentListener accepts connections and never writes a byte. It
// closes them all at the end of the test.
func newSilentListener(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().String()
}

// testCerts are the PEM files of a throwaway CA and of a server and a
// client certificate it signed, for 127.0.0.1.
type testCerts struct {
	ca, serverCert, serverKey, clientCert, clientKey string
}

func newTestCerts(t *testing.T) testCerts {
	t.Helper()
	dir := t.TempDir()
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "coord test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	writePEM := func(name, typ string, der []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	leaf := func(name string, serial int64, usage ...x509.ExtKeyUsage) (certPath, keyPath string) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: name},
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  usage,
			IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
			DNSNames:     []string{"localhost"},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		return writePEM(name+".pem", "CERTIFICATE", der), writePEM(name+"-key.pem", "PRIVATE KEY", keyDER)
	}
	c := testCerts{ca: writePEM("ca.pem", "CERTIFICATE", caDER)}
	c.serverCert, c.serverKey = leaf("server", 2, x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth)
	c.clientCert, c.clientKey = leaf("client", 3, x509.ExtKeyUsageClientAuth)
	return c
}

// startTLSEtcd starts an embedded etcd that serves clients over TLS only
// and requires a client certificate signed by the CA of certs. It returns
// its endpoint, "https://127.0.0.1:PORT". Clients must be closed before
// the test's cleanup stops it, which they are when made after it.
func startTLSEtcd(t *testing.T, certs testCerts) string {
	t.Helper()
	port := func() url.URL {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return url.URL{Scheme: "http", Host: l.Addr().String()}
	}
	client, peer := port(), port()
	client.Scheme = "https"
	cfg := embed.NewConfig()
	cfg.Dir = t.TempDir()
	cfg.TickMs, cfg.ElectionMs = coordtest.DefaultTickMs, coordtest.DefaultElectionMs
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ClientTLSInfo.CertFile = certs.serverCert
	cfg.ClientTLSInfo.KeyFile = certs.serverKey
	cfg.ClientTLSInfo.TrustedCAFile = certs.ca
	cfg.ClientTLSInfo.ClientCertAuth = true
	cfg.ListenMetricsUrls = nil
	cfg.UnsafeNoFsync = true
	cfg.EnableGRPCGateway = false
	cfg.Logger = "zap"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	// No handler goroutine may outlive Close (goleak).
	cfg.GRPCAdditionalServerOptions = []grpc.ServerOption{grpc.WaitForHandlers(true)}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatalf("starting a TLS etcd: %v", err)
	}
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		t.Fatalf("TLS etcd failed: %v", err)
	case <-time.After(waitLimit):
		t.Fatal("TLS etcd not ready")
	}
	return client.String()
}

// testClient returns a client made the way coord makes its own, closed at
// the end of the test.
func testClient(t *testing.T, c connFlags) *clientv3.Client {
	t.Helper()
	if c.dialTimeout == 0 {
		c.dialTimeout = waitLimit
	}
	c.commandTimeout = waitLimit
	cli, err := c.connect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// register registers a host for the rest of the test.
func register(t *testing.T, cli *clientv3.Client, meta coord.HostMetadata, opts coord.LivenessOptions) *coord.HostLiveness {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	h, err := coord.RegisterHostLiveness(ctx, cli, meta, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(context.Background()) })
	return h
}

func TestTLS(t *testing.T) {
	t.Parallel()
	certs := newTestCerts(t)
	ep := startTLSEtcd(t, certs)
	tlsArgs := []string{"--endpoints", ep, "--cacert", certs.ca, "--cert", certs.clientCert, "--key", certs.clientKey}
	cli := testClient(t, connFlags{endpoints: ep, cacert: certs.ca, cert: certs.clientCert, key: certs.clientKey})

	t.Run("hosts and watch, with the TLS flags before or after the command", func(t *testing.T) {
		register(t, cli, coord.HostMetadata{HostUUID: "tls-host-1", Hostname: "a"}, coord.LivenessOptions{})
		w := startCoord(t, append([]string{"watch"}, tlsArgs...)...)
		w.waitOutput(t, w.stdout, "tls-host-1")
		r := runCoord(t, append(tlsArgs, "hosts")...)
		if r.code != exitOK || !strings.Contains(r.stdout, "tls-host-1") {
			t.Fatalf("hosts: status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		h := register(t, cli, coord.HostMetadata{HostUUID: "tls-host-2", Hostname: "b"}, coord.LivenessOptions{})
		w.waitOutput(t, w.stdout, "tls-host-2")
		if err := h.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
		w.waitOutput(t, w.stdout, "down")
		if r := w.stop(t); r.code != exitOK {
			t.Fatalf("watch: status %d, stderr %q", r.code, r.stderr)
		}
	})

	t.Run("campaign and leader", func(t *testing.T) {
		c := startCoord(t, append([]string{"campaign", "/tls/election", "tls-leader"}, tlsArgs...)...)
		c.waitOutput(t, c.stdout, "leading /tls/election")
		r := runCoord(t, append([]string{"leader", "/tls/election"}, tlsArgs...)...)
		if r.code != exitOK || r.stdout != "tls-leader\n" {
			t.Fatalf("leader: status %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
		}
		if r := c.stop(t); r.code != exitOK || !strings.Contains(r.stdout, "resigned") {
			t.Fatalf("campaign: status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("without the right flags it fails within the dial timeout, saying why", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"--endpoints", ep}, "certificate signed by unknown authority"},
			{[]string{"--endpoints", ep, "--cert", certs.clientCert, "--key", certs.clientKey}, "certificate signed by unknown authority"},
			// TLS 1.3: the server refuses after the handshake; the client
			// sees the alert or a broken pipe, whichever comes first.
			{[]string{"--endpoints", ep, "--cacert", certs.ca}, "etcd at"},
			{[]string{"--endpoints", strings.TrimPrefix(ep, "https://")}, "etcd at"}, // plaintext to a TLS port
		} {
			// The handshake must fit in the dial timeout for the error to
			// say why: scaled for slow (emulated) CPUs.
			dial := time.Second * scale
			args := append(tc.args, "--dial-timeout", dial.String(), "hosts")
			r := runCoord(t, args...)
			t.Logf("coord %s: %s", strings.Join(args, " "), r.stderr)
			if r.code != exitError || !strings.Contains(r.stderr, tc.want) || r.took > 3*dial {
				t.Errorf("coord %s: status %d after %v, stderr %q, want %q", strings.Join(args, " "), r.code, r.took, r.stderr, tc.want)
			}
		}
	})

	t.Run("a bare host:port with the TLS flags uses TLS", func(t *testing.T) {
		args := append(tlsArgs, "hosts", "--endpoints", strings.TrimPrefix(ep, "https://"))
		if r := runCoord(t, args...); r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
	})

	t.Run("unreadable TLS files are errors", func(t *testing.T) {
		for _, args := range [][]string{
			{"--cacert", filepath.Join(t.TempDir(), "nope.pem")},
			{"--cacert", certs.clientKey},
			{"--cert", certs.clientCert, "--key", certs.serverKey},
		} {
			args = append(append([]string{"--endpoints", ep}, args...), "hosts")
			r := runCoord(t, args...)
			if r.code != exitError || r.took > time.Second*scale {
				t.Errorf("coord %s: status %d after %v, stderr %q", strings.Join(args, " "), r.code, r.took, r.stderr)
			}
		}
	})
}

func TestUser(t *testing.T) {
	t.Parallel()
	srv := coordtest.NewServer(t)
	ep := srv.Endpoint()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	admin := srv.NewClient(t)
	register(t, admin, coord.HostMetadata{HostUUID: "auth-host"}, coord.LivenessOptions{})
	for _, step := range []func() error{
		func() error { _, err := admin.UserAdd(ctx, "root", "s3cret:pw"); return err },
		func() error { _, err := admin.RoleAdd(ctx, "root"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.AuthEnable(ctx); return err },
	} {
		if err := step(); err != nil {
			t.Fatalf("enabling auth: %v", err)
		}
	}

	for _, user := range [][]string{{"--user", "root:s3cret:pw"}, {"--user", "root", "--password", "s3cret:pw"}} {
		t.Run("hosts "+strings.Join(user, " "), func(t *testing.T) {
			r := runCoord(t, append([]string{"hosts", "--endpoints", ep}, user...)...)
			if r.code != exitOK || !strings.Contains(r.stdout, "auth-host") {
				t.Fatalf("status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
		})
	}

	t.Run("campaign, leader and watch as root", func(t *testing.T) {
		auth := []string{"--endpoints", ep, "--user", "root:s3cret:pw"}
		w := startCoord(t, append(auth, "watch")...)
		w.waitOutput(t, w.stdout, "auth-host")
		c := startCoord(t, append(auth, "campaign", "/auth/election", "root-leader")...)
		c.waitOutput(t, c.stdout, "leading")
		r := runCoord(t, append(auth, "leader", "/auth/election")...)
		if r.code != exitOK || r.stdout != "root-leader\n" {
			t.Fatalf("leader: status %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
		}
		if r := c.stop(t); r.code != exitOK {
			t.Fatalf("campaign: status %d, stderr %q", r.code, r.stderr)
		}
		if r := w.stop(t); r.code != exitOK {
			t.Fatalf("watch: status %d, stderr %q", r.code, r.stderr)
		}
	})

	t.Run("a wrong password or no user is refused", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"hosts", "--user", "root:wrong"}, "authentication failed"},
			{[]string{"hosts"}, "user name is empty"},
			{[]string{"watch"}, "user name is empty"},
			{[]string{"leader", "/auth/election"}, "user name is empty"},
			{[]string{"campaign", "/auth/election", "x"}, "user name is empty"},
		} {
			r := runCoord(t, append(tc.args, "--endpoints", ep)...)
			t.Logf("coord %s: %s", strings.Join(tc.args, " "), r.stderr)
			if r.code != exitError || !strings.Contains(r.stderr, tc.want) {
				t.Errorf("coord %s: status %d, stderr %q, want %q", strings.Join(tc.args, " "), r.code, r.stderr, tc.want)
			}
		}
	})
}

// TestQuorumLost: with 2 of 3 members down, the survivor answers but the
// cluster has no leader. hosts and leader say so, within --dial-timeout,
// rather than that etcd cannot be reached; leaderless tells the cases apart.
func TestQuorumLost(t *testing.T) {
	t.Parallel()
	c := coordtest.NewCluster(t, 3)
	members := c.Members()
	var eps []string
	for _, m := range members {
		eps = append(eps, m.Endpoint())
	}
	all := strings.Join(eps, ",")
	survivor := members[0]

	// With a quorum, both commands work.
	cli := testClient(t, connFlags{endpoints: all})
	h := register(t, cli, coord.HostMetadata{HostUUID: "quorum-host"}, coord.LivenessOptions{})
	if r := runCoord(t, "hosts", "--endpoints", all); r.code != exitOK || !strings.Contains(r.stdout, "quorum-host") {
		t.Fatalf("hosts with a quorum: status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	// Now, while etcd can revoke its lease.
	if err := h.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if r := runCoord(t, "leader", "/quorum/e", "--endpoints", all); r.code != exitError || !strings.Contains(r.stderr, "election /quorum/e has no leader") {
		t.Fatalf("leader with a quorum: status %d, stderr %q", r.code, r.stderr)
	}
	// Not a defer: the parallel subtests below run after this function.
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitLimit)
	t.Cleanup(cancel)
	healthy := connFlags{endpoints: all, dialTimeout: waitLimit}
	// Eventually, not at once: under a slow emulator a 100 ms election
	// timeout can run out, and while the members elect a new leader none
	// has one, which leaderless rightly reports.
	eventually(t, "leaderless false with a quorum", func() bool { return !healthy.leaderless(ctx, cli) })

	members[1].Stop()
	members[2].Stop()
	// The survivor knows it has no leader one election timeout later.
	probe := survivor.NewClient(t)
	eventually(t, "the survivor has no leader", func() bool {
		sctx, scancel := context.WithTimeout(ctx, time.Second*scale)
		defer scancel()
		resp, err := probe.Status(sctx, survivor.Endpoint())
		return err == nil && resp.Leader == 0
	})

	dial := time.Second * scale
	for _, ep := range []string{all, survivor.Endpoint()} {
		for _, cmd := range [][]string{{"hosts"}, {"leader", "/quorum/e"}} {
			t.Run(strings.Join(cmd, " ")+" at "+ep, func(t *testing.T) {
				t.Parallel()
				args := append([]string{"--endpoints", ep, "--dial-timeout", dial.String()}, cmd...)
				r := runCoord(t, args...)
				t.Logf("coord %s: %s", strings.Join(args, " "), r.stderr)
				if r.code != exitError {
					t.Errorf("status %d, want %d; stderr %q", r.code, exitError, r.stderr)
				}
				want := "etcd at " + ep + " answers, but the cluster has no leader: quorum lost"
				if !strings.Contains(r.stderr, want) || strings.Contains(r.stderr, "cannot reach") {
					t.Errorf("stderr %q, want %q", r.stderr, want)
				}
				if r.took > dial+1500*time.Millisecond*scale {
					t.Errorf("took %v with --dial-timeout %v", r.took, dial)
				}
			})
		}
	}

	// A request held until it timed out (a member that has just lost its
	// leader) is told apart from an unreachable etcd by the members' status.
	t.Run("leaderless and explain", func(t *testing.T) {
		t.Parallel()
		lost := connFlags{endpoints: all, dialTimeout: dial}
		if !lost.leaderless(ctx, cli) {
			t.Error("leaderless: false without a quorum")
		}
		err := lost.explain(ctx, cli, fmt.Errorf("list hosts: %w", context.DeadlineExceeded))
		if err == nil || !strings.Contains(err.Error(), "the cluster has no leader") {
			t.Errorf("explain(deadline exceeded) = %v", err)
		}
		other := errors.New("permission denied")
		if err := lost.explain(ctx, cli, other); err != other {
			t.Errorf("explain(%v) = %v", other, err)
		}
		done, stop := context.WithCancel(ctx)
		stop()
		if err := lost.explain(done, cli, context.DeadlineExceeded); err != context.DeadlineExceeded {
			t.Errorf("explain after the command's end = %v", err)
		}
		// Nothing answers: not leaderless.
		down := connFlags{endpoints: strings.Join(eps[1:], ","), dialTimeout: dial}
		downCli, err := clientv3.New(clientv3.Config{Endpoints: eps[1:], Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		defer downCli.Close()
		if down.leaderless(ctx, downCli) {
			t.Error("leaderless: true with no member up")
		}
	})
}
