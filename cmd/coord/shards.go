package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// shardInfo is a shard as coord shards shows it: its election's candidates,
// the owner first, then the standbys in the order they would lead.
type shardInfo struct {
	Shard    string           `json:"shard"`
	Key      string           `json:"key"` // the shard's election key
	Owner    shardCandidate   `json:"owner"`
	Standbys []shardCandidate `json:"standbys"`
}

// shardCandidate is a candidacy in a shard's election.
type shardCandidate struct {
	Identity string `json:"identity"` // a ShardSet's is its host's UUID
	// Hostname is that of the live host whose UUID is Identity, from its
	// metadata under --host-prefix, if there is one.
	Hostname string `json:"hostname,omitempty"`
	// Token is the candidacy's create revision: the owner's fencing token,
	// and the one a standby will lead with. etcd keeps no timestamps: how
	// long an owner has held its shard cannot be read, but a larger token
	// is a later candidacy.
	Token int64  `json:"token"`
	Lease string `json:"lease"` // hex, as etcdctl shows lease IDs
	// What the candidate's ShardSet announces as a member (under
	// <prefix>@members/), if it does.
	Weight   float64 `json:"weight,omitempty"`
	Zone     string  `json:"zone,omitempty"`
	Draining bool    `json:"draining,omitempty"`
}

// String shows a candidate's identity, and its hostname if it is a live
// host's UUID, its zone, a weight other than 1 and a drain, if its member
// key says so.
func (c shardCandidate) String() string {
	var notes []string
	if c.Hostname != "" {
		notes = append(notes, c.Hostname)
	}
	if c.Weight != 0 && c.Weight != 1 {
		notes = append(notes, fmt.Sprintf("weight %g", c.Weight))
	}
	if c.Zone != "" {
		notes = append(notes, "zone "+c.Zone)
	}
	if c.Draining {
		notes = append(notes, "draining")
	}
	if len(notes) == 0 {
		return c.Identity
	}
	return c.Identity + " (" + strings.Join(notes, ", ") + ")"
}

func cmdShards(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("shards", "", `List the shards of the ShardSets under --prefix: each shard is an election
at <prefix><shard>, whose candidates are the hosts in line for it. For each
shard found, print its owner (the candidate created first, as the election
defines its leader), its fencing token, and its standbys in the order they
would take over; a candidate that is a live host's UUID (a ShardSet's
candidates are) is shown with the hostname of its metadata under
--host-prefix. A shard nobody campaigns for leaves nothing in etcd and is
not listed. etcd keeps no timestamps, so how long an owner has held its
shard cannot be read: TOKEN, the create revision of the owner's candidacy,
is what grows with each new ownership. A candidate's weight (other than 1),
zone and drain are shown as its ShardSet announces them (its member key,
under <prefix>@members/). It only reads: no lease or key is created. Keys
under the prefix that are neither candidates nor members are skipped with
a warning on stderr.`, true)
	c.StringVar(&c.conn.prefix, "prefix", coord.ShardsPrefix, "etcd `prefix` of the shard elections; ends in /")
	hostPrefix := c.String("host-prefix", coord.HostsPrefix, "etcd `prefix` of the host registrations, for the hostnames; ends in /")
	output := c.output("output `format`: text (a table) or json", "text", "json")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	if !strings.HasSuffix(*hostPrefix, "/") {
		return usagef("--host-prefix %q must end in /", *hostPrefix)
	}
	list := func(ctx context.Context, cli *clientv3.Client, prefix string, stderr io.Writer) ([]shardInfo, error) {
		return listShards(ctx, cli, prefix, *hostPrefix, stderr)
	}
	return runListing(ctx, c, *output == "json", stdout, stderr, "shard", list, printShards)
}

// listShards reads the candidates of the shard elections under prefix,
// and the hosts under hostPrefix, in one request (one revision), and
// returns the shards sorted by name, their candidates in line order: by
// create revision, as the election orders them, each with its host's
// hostname. Keys that are not <prefix><shard>/<lease> are skipped with a
// warning on stderr.
func listShards(ctx context.Context, cli *clientv3.Client, prefix, hostPrefix string, stderr io.Writer) ([]shardInfo, error) {
	resp, err := cli.Txn(ctx).Then(clientv3.OpGet(prefix, clientv3.WithPrefix()), clientv3.OpGet(hostPrefix, clientv3.WithPrefix())).Commit()
	if err != nil {
		return nil, fmt.Errorf("list shards under %s: %w", prefix, err)
	}
	shards, _ := decodeShards(prefix, resp.Responses[0].GetResponseRange().Kvs, stderr)
	names := hostnames(hostPrefix, resp.Responses[1].GetResponseRange().Kvs)
	for i := range shards {
		shards[i].Owner.Hostname = names[shards[i].Owner.Identity]
		for j := range shards[i].Standbys {
			shards[i].Standbys[j].Hostname = names[shards[i].Standbys[j].Identity]
		}
	}
	return shards, nil
}

// hostnames returns the hostname of each host of kvs, the keys under
// prefix, by HostUUID: of those whose value is HostMetadata naming the
// host its key names, as coord's watcher reads them.
func hostnames(prefix string, kvs []*mvccpb.KeyValue) map[string]string {
	names := map[string]string{}
	for _, kv := range kvs {
		var m coord.HostMetadata
		if json.Unmarshal(kv.Value, &m) == nil && m.HostUUID == strings.TrimPrefix(string(kv.Key), prefix) {
			names[m.HostUUID] = m.Hostname
		}
	}
	return names
}

// decodeShards reads the keys under a shard set's prefix, as listShards
// gets them: the shards sorted by name, their candidates in line order,
// and the members' announcements by HostUUID.
func decodeShards(prefix string, kvs []*mvccpb.KeyValue, stderr io.Writer) ([]shardInfo, map[string]coord.ShardMember) {
	by := map[string][]*mvccpb.KeyValue{}
	members := map[string]coord.ShardMember{}
	for _, kv := range kvs {
		key := string(kv.Key)
		shard, lease, ok := strings.Cut(strings.TrimPrefix(key, prefix), "/")
		if shard == coord.ShardMemberSegment && ok {
			var m coord.ShardMember
			if json.Unmarshal(kv.Value, &m) == nil && m.HostUUID == lease {
				members[m.HostUUID] = m
				continue
			}
		}
		if !ok || shard == "" || lease == "" || strings.Contains(lease, "/") || strings.HasPrefix(shard, "@") {
			fmt.Fprintf(stderr, "coord: skipping %s: not a candidate key (%s<shard>/<lease>)\n", key, prefix)
			continue
		}
		by[shard] = append(by[shard], kv)
	}
	var out []shardInfo
	for shard, kvs := range by {
		slices.SortFunc(kvs, inLine)
		cands := make([]shardCandidate, len(kvs))
		for i, kv := range kvs {
			c := shardCandidate{Identity: string(kv.Value), Token: kv.CreateRevision, Lease: fmt.Sprintf("%x", kv.Lease)}
			if m, ok := members[c.Identity]; ok {
				c.Weight, c.Zone, c.Draining = m.Weight, m.Zone, m.Draining
			}
			cands[i] = c
		}
		out = append(out, shardInfo{Shard: shard, Key: prefix + shard, Owner: cands[0], Standbys: append([]shardCandidate{}, cands[1:]...)})
	}
	slices.SortFunc(out, func(a, b shardInfo) int { return strings.Compare(a.Shard, b.Shard) })
	return out, members
}

// inLine orders the candidates of an election as it orders them: by
// create revision, the leader first. Only keys put in one transaction
// share a create revision (no election does that): the key breaks the
// tie, for a stable order.
func inLine(a, b *mvccpb.KeyValue) int {
	return cmp.Or(cmp.Compare(a.CreateRevision, b.CreateRevision), bytes.Compare(a.Key, b.Key))
}

// printShards prints shards as a table.
func printShards(w io.Writer, shards []shardInfo) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SHARD\tOWNER\tTOKEN\tSTANDBYS")
	for _, s := range shards {
		var standbys []string
		for _, c := range s.Standbys {
			standbys = append(standbys, c.String())
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", s.Shard, dash(s.Owner.String()), s.Owner.Token, dash(strings.Join(standbys, ",")))
	}
	return tw.Flush()
}
