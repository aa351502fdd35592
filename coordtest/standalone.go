package coordtest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/internal/testenv"
)

// Standalone is a Server outside a test: for runnable examples, demos and
// tools, which have no testing.TB to fail. Create it with Start; the caller
// must Close it. Its methods return errors where a Server's fail the test.
// Its client and peer ports and its data directory are fixed for its whole
// life, across Stop and Restart. All methods are safe for concurrent use.
type Standalone struct {
	s      *Server          // without a testing.TB: only its unexported methods are used
	shared *clientv3.Client // created by Start, closed by Close
}

// Start starts a Standalone tuned by cfg and waits (up to 30 s) until it is
// ready to serve. Its data lives in a new subdirectory of dir, which is
// created if needed and may hold other files; the caller removes dir once
// done (after Close: the data stays in place until then). Start returns an
// error if dir cannot be created or the server cannot be started, and then
// leaves no goroutine behind.
func Start(dir string, cfg Config) (*Standalone, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("coordtest: creating data directory: %w", err)
	}
	s := newServer(nil, cfg)
	if err := s.start(dir); err != nil {
		s.Close()
		return nil, fmt.Errorf("coordtest: %w", err)
	}
	return standalone(s)
}

// StartAt is Start with the data in dir itself and the client listener on
// addr ("host:port"; port 0 picks a free one): a development etcd at a
// known address, whose data outlives it. dir is created if needed; the
// data an earlier Standalone left there is used again (its keys, its
// leases). The peer listener is on a free loopback port: the server is a
// cluster of one. The client URL is http://addr, as Endpoint says (with the
// port picked, if 0).
func StartAt(dir, addr string, cfg Config) (*Standalone, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("coordtest: client address %q: %w", addr, err)
	}
	if port == "0" {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("coordtest: picking a free port on %s: %w", host, err)
		}
		addr = l.Addr().String()
		l.Close()
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("coordtest: creating data directory: %w", err)
	}
	ports, err := testenv.LoopbackPorts(1)
	if err != nil {
		return nil, fmt.Errorf("coordtest: %w", err)
	}
	s := newServer(nil, cfg)
	s.dir = dir
	s.clientURL = url.URL{Scheme: "http", Host: addr}
	s.peerURL = loopbackURL("http", ports[0])
	s.lifeMu.Lock()
	err = s.startLocked()
	s.lifeMu.Unlock()
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("coordtest: starting etcd: %w", err)
	}
	return standalone(s)
}

// standalone wraps a started server, with its shared client.
func standalone(s *Server) (*Standalone, error) {
	// Created now, so that Client has no failure to report.
	shared, err := s.sharedClient(s.ClientConfig())
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("coordtest: creating client of %s: %w", s.Endpoint(), err)
	}
	return &Standalone{s: s, shared: shared}, nil
}

// Endpoint returns the client URL of the server, "http://127.0.0.1:PORT". It
// does not change across Stop and Restart.
func (x *Standalone) Endpoint() string { return x.s.Endpoint() }

// ClientConfig is Server.ClientConfig: a configuration for a client of this
// server, which the caller creates, owns and must close.
func (x *Standalone) ClientConfig() clientv3.Config { return x.s.ClientConfig() }

// Client returns the client of this server shared by all its callers,
// created by Start. Close closes it; callers must not. After Close it
// returns that closed client, whose requests fail.
func (x *Standalone) Client() *clientv3.Client { return x.shared }

// Dial returns a new client of this server with its own connection. Close
// closes it; closing it earlier as well is harmless. It returns an error if
// the client cannot be created, or once Close has started.
func (x *Standalone) Dial() (*clientv3.Client, error) {
	c, err := newTrackedClient(x.s.ClientConfig(), x.s)
	if err != nil {
		return nil, fmt.Errorf("coordtest: %w", err)
	}
	return c.c, nil
}

// Stop is Server.Stop: it stops the server, as a crash would for its
// clients, which stay open and reconnect after Restart. It is idempotent,
// and does nothing after Close.
func (x *Standalone) Stop() { x.s.Stop() }

// Restart is Server.Restart: it stops the server if it is running and starts
// it again on the same data directory and ports, and returns once it is
// ready to serve. It returns an error if the server cannot be started again
// (it is then stopped), or once Close has started.
func (x *Standalone) Restart() error { return wrapErr(x.s.restart()) }

// Revision is Server.Revision: the current revision of the store, read
// linearizably. It returns an error if the server is stopped or closed, or
// the read fails (e.g. ctx ends).
func (x *Standalone) Revision(ctx context.Context) (int64, error) {
	rev, err := x.s.revision(ctx)
	return rev, wrapErr(err)
}

// Compact is Server.Compact: it compacts the store at its current revision,
// waits until the compaction is physically applied, and returns that
// revision. It returns an error if the server is stopped or closed, or the
// compaction fails.
func (x *Standalone) Compact(ctx context.Context) (int64, error) {
	rev, err := x.s.compact(ctx)
	return rev, wrapErr(err)
}

// Close is Server.Close: it closes every client handed out (Client's and
// Dial's), then stops the server, and returns once none of their goroutines
// remains. The server cannot be restarted afterwards, and its data stays in
// its directory. Close is idempotent and safe to call concurrently: every
// call returns once the first is done.
func (x *Standalone) Close() { x.s.Close() }

// wrapErr prefixes a failure with the package name, as the messages of a
// test failure are.
func wrapErr(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("coordtest: %w", err)
}
