package coordtest

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// errClosed is what owner.sharedClient returns once the owner is closed.
var errClosed = errors.New("closed")

// owner keeps what a Server, a Cluster or a Proxy hands out (its shared
// client, the clients and proxies created through it) for its cleanup to
// close. It is ready for use once gone is set, and safe for concurrent use.
type owner struct {
	// gone ends the error of a request made once the owner is closed:
	// "client requested after " + gone.
	gone string

	mu      sync.Mutex // guards the fields below
	closed  bool       // closeClients has started; hand out nothing more
	shared  *clientv3.Client
	clients []*clientCloser
	proxies []*Proxy
}

// proxyOwner is what a Proxy and its clients are registered with, to be
// closed by its cleanup: a Server or a Cluster, through their owner.
type proxyOwner interface {
	registrar
	registerProxy(*Proxy) error
}

// register records a client to close at cleanup. It fails if the owner is
// closed.
func (o *owner) register(c *clientCloser) error {
	return o.track("client", func() { o.clients = append(o.clients, c) })
}

// registerProxy records a proxy to close at cleanup. It fails if the owner
// is closed.
func (o *owner) registerProxy(p *Proxy) error {
	return o.track("proxy", func() { o.proxies = append(o.proxies, p) })
}

// track calls add under o.mu, unless the owner is closed.
func (o *owner) track(what string, add func()) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return fmt.Errorf("%s requested after %s", what, o.gone)
	}
	add()
	return nil
}

// sharedClient returns the client shared by all the callers, created from
// cfg on the first call and closed by closeClients. It returns errClosed
// once the owner is closed.
func (o *owner) sharedClient(cfg clientv3.Config) (*clientv3.Client, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil, errClosed
	}
	if o.shared == nil {
		c, err := clientv3.New(cfg)
		if err != nil {
			return nil, err
		}
		o.shared = c
		o.clients = append(o.clients, &clientCloser{c: c})
	}
	return o.shared, nil
}

// clientFor is sharedClient for the Client method of a test's Server or
// Cluster (typ), connected to what of names: it fails t where sharedClient
// returns an error.
func (o *owner) clientFor(t testing.TB, cfg clientv3.Config, typ, of string) *clientv3.Client {
	t.Helper()
	c, err := o.sharedClient(cfg)
	if errors.Is(err, errClosed) {
		t.Fatalf("coordtest: %s.Client called after %s", typ, o.gone)
	}
	if err != nil {
		t.Fatalf("coordtest: creating client of %s: %v", of, err)
	}
	return c
}

// closeClients closes the owner to new requests, closes its clients and
// returns its proxies, which the caller closes once what they front is
// stopped (so that no connection through them keeps their close waiting).
func (o *owner) closeClients() []*Proxy {
	o.mu.Lock()
	o.closed = true
	clients, proxies := o.clients, o.proxies
	o.clients, o.proxies = nil, nil
	o.mu.Unlock()

	for _, c := range clients {
		c.close()
	}
	return proxies
}

// clientCloser closes a client once, however many owners ask.
type clientCloser struct {
	once sync.Once
	c    *clientv3.Client
}

func (c *clientCloser) close() {
	// Client.Close reports the cancellation of its own context even on
	// success; there is nothing useful to do with its error here.
	c.once.Do(func() { _ = c.c.Close() })
}

// registrar is what a client is registered with, to be closed by its
// cleanup: an owner.
type registrar interface{ register(*clientCloser) error }

// newTestClient is the NewClient of a Server, Cluster, Member or Proxy: it
// creates a client from cfg, registered with each owner and closed by a
// t.Cleanup as well, and fails the test (through t) on error.
func newTestClient(t testing.TB, cfg clientv3.Config, owners ...registrar) *clientv3.Client {
	t.Helper()
	c, err := newTrackedClient(cfg, owners...)
	if err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	t.Cleanup(c.close)
	return c.c
}

// newTrackedClient creates a client from cfg and registers it with each
// owner, to be closed when the first of them cleans up.
func newTrackedClient(cfg clientv3.Config, owners ...registrar) (*clientCloser, error) {
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating client of %v: %w", cfg.Endpoints, err)
	}
	c := &clientCloser{c: cli}
	for _, o := range owners {
		if err := o.register(c); err != nil {
			c.close()
			return nil, err
		}
	}
	return c, nil
}
