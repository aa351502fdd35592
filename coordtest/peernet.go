package coordtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"
	"sync/atomic"
	"time"
)

// peerDialTimeout bounds a peer proxy's dial of its member's listener.
const peerDialTimeout = time.Second

// peerNet is the network between the members of a Cluster: a proxy in front
// of each member's peer listener, whose URL the member advertises as its
// peer URL, so that every request from one member to another passes
// through the proxy of its target. It is an HTTP reverse proxy rather than a
// TCP one because a connection alone does not tell which member sent it:
// raft requests name their sender in the X-Server-From header.
type peerNet struct {
	tr *http.Transport // to the members' peer listeners

	mu       sync.Mutex // guards the fields below
	closed   bool
	isolated map[*Member]bool
	down     map[*Member]bool   // stopping or stopped
	ids      map[string]*Member // hex member ID (as in X-Server-From) to member
	inflight map[*peerRequest]struct{}
	proxies  []*peerProxy
	handlers sync.WaitGroup // the requests in inflight; Add under mu
}

// peerRequest is a request in progress through a peer proxy.
type peerRequest struct {
	// fromID is the member ID of the sender, "" if the request does not name
	// it. It is resolved to a member only when needed: requests made while
	// the cluster starts precede the members' IDs being known.
	fromID string
	to     *Member
	cancel context.CancelFunc
	done   chan struct{} // closed once its handler has returned
}

// peerProxy is the proxy in front of one member's peer listener.
type peerProxy struct {
	net    *peerNet
	to     *Member
	url    url.URL
	target atomic.Pointer[url.URL] // the member's peer listener; nil until chosen
	srv    *http.Server
	rp     *httputil.ReverseProxy
	served chan struct{} // closed when srv.Serve has returned
}

func newPeerNet() *peerNet {
	return &peerNet{
		tr: &http.Transport{
			Proxy:       nil,
			DialContext: (&net.Dialer{Timeout: peerDialTimeout}).DialContext,
			// No connection to a member's peer listener outlives its
			// request; see setDown.
			DisableKeepAlives:  true,
			DisableCompression: true,
		},
		isolated: make(map[*Member]bool),
		down:     make(map[*Member]bool),
		ids:      make(map[string]*Member),
		inflight: make(map[*peerRequest]struct{}),
	}
}

// newProxy starts the peer proxy of member m on a fresh loopback port. It
// forwards to the member's peer listener once its target is set.
func (n *peerNet) newProxy(m *Member) (*peerProxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listening: %w", err)
	}
	discard := log.New(io.Discard, "", 0)
	p := &peerProxy{
		net:    n,
		to:     m,
		url:    loopbackURL("http", l.Addr().(*net.TCPAddr).Port),
		served: make(chan struct{}),
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			target := p.target.Load()
			if target == nil {
				panic(http.ErrAbortHandler)
			}
			r.SetURL(target)
		},
		Transport: n.tr,
		// Stream responses (raft message streams) without delay.
		FlushInterval: -1,
		ErrorLog:      discard,
		// The member is down or the request was cut: drop the connection,
		// as the network would, rather than answer for the member.
		ErrorHandler: func(http.ResponseWriter, *http.Request, error) { panic(http.ErrAbortHandler) },
	}
	p.srv = &http.Server{
		Handler:           p,
		ErrorLog:          discard,
		ReadHeaderTimeout: time.Minute,
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		l.Close()
		return nil, errors.New("cluster cleaned up")
	}
	n.proxies = append(n.proxies, p)
	go func() {
		defer close(p.served)
		_ = p.srv.Serve(l)
	}()
	return p, nil
}

func (p *peerProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	req, ok := p.net.admit(r.Header.Get("X-Server-From"), p.to, cancel)
	if !ok {
		// Cut off: drop the connection.
		panic(http.ErrAbortHandler)
	}
	defer p.net.done(req)
	p.rp.ServeHTTP(w, r.WithContext(ctx))
}

// admit registers a request from the member with ID fromID to member to,
// unless one of them is isolated or down, or the network is closed.
func (n *peerNet) admit(fromID string, to *Member, cancel context.CancelFunc) (*peerRequest, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed || n.blockedLocked(to) || n.blockedLocked(n.ids[fromID]) {
		return nil, false
	}
	req := &peerRequest{fromID: fromID, to: to, cancel: cancel, done: make(chan struct{})}
	n.inflight[req] = struct{}{}
	n.handlers.Add(1)
	return req, true
}

func (n *peerNet) done(req *peerRequest) {
	n.mu.Lock()
	delete(n.inflight, req)
	n.mu.Unlock()
	close(req.done)
	n.handlers.Done()
}

func (n *peerNet) setID(m *Member, id string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.ids[id] = m
}

func (n *peerNet) isCut(m *Member) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.isolated[m]
}

func (n *peerNet) blockedLocked(m *Member) bool {
	return m != nil && (n.isolated[m] || n.down[m])
}

// abortLocked aborts the requests in progress between m and its peers,
// and returns them.
func (n *peerNet) abortLocked(m *Member) []*peerRequest {
	var aborted []*peerRequest
	for req := range n.inflight {
		if req.to == m || n.ids[req.fromID] == m {
			req.cancel()
			aborted = append(aborted, req)
		}
	}
	return aborted
}

// cut isolates m, aborts the requests in progress between it and its
// peers, and returns once their handlers have returned: from then on no
// byte between m and its peers goes through the proxies (a raft message
// read before the cut but not yet forwarded is dropped, not delivered
// after Isolate returned). The wait is bounded by proxyCloseTimeout as a
// safeguard: a handler returns as soon as its request is cancelled.
func (n *peerNet) cut(m *Member) {
	n.mu.Lock()
	n.isolated[m] = true
	aborted := n.abortLocked(m)
	n.mu.Unlock()
	timer := time.NewTimer(proxyCloseTimeout)
	defer timer.Stop()
	for _, req := range aborted {
		select {
		case <-req.done:
		case <-timer.C:
			return
		}
	}
}

// setDown marks m as stopping (and then stopped) or starting. While it is
// down the network drops its requests, and marking it down aborts those in
// progress. A member is disconnected this way before it stops because etcd's
// peer listener resets a connection's read deadline on every read, which
// can keep the graceful shutdown of its peer server (in Etcd.Close) waiting
// its full second for a connection whose request has just ended; a
// connection closed by the proxy ends at once.
func (n *peerNet) setDown(m *Member, down bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !down {
		delete(n.down, m)
		return
	}
	n.down[m] = true
	n.abortLocked(m)
}

func (n *peerNet) heal(m *Member) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.isolated, m)
}

// close stops the proxies and waits until all their requests have ended.
// The members should be stopped first.
func (n *peerNet) close() error {
	n.mu.Lock()
	n.closed = true
	proxies := n.proxies
	for req := range n.inflight {
		req.cancel()
	}
	n.mu.Unlock()

	for _, p := range proxies {
		// Closes the listener and every connection; the handlers still
		// running end with their cancelled requests.
		_ = p.srv.Close()
		<-p.served
	}
	if !waitTimeout(&n.handlers, proxyCloseTimeout) {
		return fmt.Errorf("peer proxy requests still running %v after closing", proxyCloseTimeout)
	}
	n.tr.CloseIdleConnections()
	return nil
}
