package coord

import (
	"errors"
	"fmt"
	"sync"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
)

// An etcd replaced or restored (a cluster rebuilt, a development etcd
// started again without its data, a restore from a snapshot) counts its
// revisions from where its data left off, below those we have seen, and
// may be another cluster. A watch resumed on it from our revision waits in
// silence until etcd's revision passes it, then goes on as if nothing
// happened: it must be noticed, and everything listed again.

// errEtcdReplaced is what etcdMark.see's errors wrap.
var errEtcdReplaced = errors.New("etcd replaced or restored")

// etcdMark follows the etcd an object talks to, from the headers of its
// answers: the cluster, and the highest revision seen.
type etcdMark struct {
	mu      sync.Mutex
	cluster uint64
	rev     int64
	epoch   uint64 // how many replacements were found
}

// markAt is what a mark had seen when a request was sent: a linearizable
// answer to it (a write, a linearizable read) was given after every
// write etcd acknowledged before, so it is not below rev. Answers to
// requests sent earlier, still in flight, may be: they are compared with
// what was seen when they were sent, never with what was seen since.
type markAt struct {
	epoch uint64
	rev   int64
}

// at returns what the mark has seen, for a linearizable request about to
// be sent.
func (m *etcdMark) at() *markAt {
	m.mu.Lock()
	defer m.mu.Unlock()
	return &markAt{epoch: m.epoch, rev: m.rev}
}

// see records what h says of etcd. since is what the mark had seen when
// the request was sent (see at), nil for an answer that may lag behind
// one given before (a serializable read, a watch: a member that lags may
// give it). It returns an error when etcd was replaced since: another
// cluster, or a linearizable answer at a revision below one seen before
// it was asked. From then on, the new etcd is the one followed.
func (m *etcdMark) see(h *etcdserverpb.ResponseHeader, since *markAt) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	err := m.compareLocked(h, since)
	if err != nil {
		m.cluster, m.rev, m.epoch = h.ClusterId, h.Revision, m.epoch+1
		return err
	}
	m.takeLocked(h, since)
	return nil
}

// replacedBy returns the error see would, and takes h in only if there is
// none: the one who lists again sees h's etcd itself, and tells.
func (m *etcdMark) replacedBy(h *etcdserverpb.ResponseHeader, since *markAt) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.compareLocked(h, since); err != nil {
		return err
	}
	m.takeLocked(h, since)
	return nil
}

// compareLocked returns the error saying that h's etcd replaced the one
// seen, nil if it did not. An answer to a request sent before a
// replacement was found says nothing: it may be of either etcd.
func (m *etcdMark) compareLocked(h *etcdserverpb.ResponseHeader, since *markAt) error {
	switch {
	case m.cluster == 0, since != nil && since.epoch != m.epoch:
		return nil
	case h.ClusterId == m.cluster && (since == nil || h.Revision >= since.rev):
		return nil
	}
	rev := m.rev
	if since != nil {
		rev = since.rev
	}
	return fmt.Errorf("%w: cluster %x at revision %d, after cluster %x at revision %d",
		errEtcdReplaced, h.ClusterId, h.Revision, m.cluster, rev)
}

// takeLocked takes in what h says of etcd, unless h answers a request
// sent before a replacement was found.
func (m *etcdMark) takeLocked(h *etcdserverpb.ResponseHeader, since *markAt) {
	if since != nil && since.epoch != m.epoch {
		return
	}
	m.cluster, m.rev = h.ClusterId, max(m.rev, h.Revision)
}

// replacedNote carries the word that etcd was replaced from the one who
// found it to the one who lists again: it holds the error until cleared,
// and wakes the lister.
type replacedNote struct {
	mu   sync.Mutex
	err  error
	wake chan struct{} // a wake-up not taken yet
}

func newReplacedNote() *replacedNote { return &replacedNote{wake: make(chan struct{}, 1)} }

// set records err and wakes the lister.
func (n *replacedNote) set(err error) {
	n.mu.Lock()
	n.err = err
	n.mu.Unlock()
	select {
	case n.wake <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// get returns the error recorded, nil once cleared.
func (n *replacedNote) get() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.err
}

// clear records that the lister has listed again: the words told so far
// are forgotten, with their wake-up. They are of the etcd the listing saw,
// or of one it replaced: answers of the new etcd keep telling until a
// listing has taken it in, and would have the set list again for nothing.
// (A word of yet another etcd, told between the listing's answer and
// here, is not lost: the next linearizable answer of that etcd tells
// again, compared with the listing's.)
func (n *replacedNote) clear() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.err = nil
	select {
	case <-n.wake:
	default:
	}
}
