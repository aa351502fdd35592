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
}

// see records what h says of etcd. linear says whether the answer was
// given after every write etcd acknowledged before it was asked (a write,
// a linearizable read): a serializable read or a watch may come from a
// member that lags behind one that answered before. It returns an error
// when etcd was replaced since the answers seen before: another cluster,
// or a linear answer at a revision below one seen. From then on, the new
// etcd is the one followed.
func (m *etcdMark) see(h *etcdserverpb.ResponseHeader, linear bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	err := m.compareLocked(h, linear)
	if err != nil {
		m.rev = 0
	}
	m.cluster, m.rev = h.ClusterId, max(m.rev, h.Revision)
	return err
}

// replacedBy returns the error see would, and takes h in only if there is
// none: the one who lists again sees h's etcd itself, and tells.
func (m *etcdMark) replacedBy(h *etcdserverpb.ResponseHeader, linear bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.compareLocked(h, linear); err != nil {
		return err
	}
	m.cluster, m.rev = h.ClusterId, max(m.rev, h.Revision)
	return nil
}

// compareLocked returns the error saying that h's etcd replaced the one
// seen, nil if it did not.
func (m *etcdMark) compareLocked(h *etcdserverpb.ResponseHeader, linear bool) error {
	if m.cluster == 0 || h.ClusterId == m.cluster && (!linear || h.Revision >= m.rev) {
		return nil
	}
	return fmt.Errorf("%w: cluster %x at revision %d, after cluster %x at revision %d",
		errEtcdReplaced, h.ClusterId, h.Revision, m.cluster, m.rev)
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

// clear records that the lister has listed again.
func (n *replacedNote) clear() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.err = nil
}
