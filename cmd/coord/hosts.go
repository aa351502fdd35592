package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// liveHost is a host as coord hosts shows it: its metadata, and its lease.
type liveHost struct {
	coord.HostMetadata
	Lease string `json:"lease,omitempty"` // hex, as etcdctl shows lease IDs
	// TTLLeft is the lease's remaining time in seconds, -1 once expired
	// (etcd deletes the key within about 500 ms).
	TTLLeft    int64 `json:"ttl_left_s"`
	GrantedTTL int64 `json:"granted_ttl_s"`
}

func cmdHosts(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("hosts", "", `List the live hosts registered under --prefix: UUID, hostname, version,
labels and the time left on each host's lease. Values under the prefix that
are not hosts are skipped with a warning on stderr.`, true)
	c.conn.registerPrefix(c.FlagSet)
	output := c.output("output `format`: table or json", "table", "json")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	return runListing(ctx, c, *output == "json", stdout, stderr, "host", listHosts, printHosts)
}

// printHosts prints hosts as a table.
func printHosts(w io.Writer, hosts []liveHost) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "UUID\tHOSTNAME\tVERSION\tLABELS\tTTL LEFT")
	for _, h := range hosts {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", h.HostUUID, dash(h.Hostname), dash(h.Version),
			dash(formatLabels(h.Labels)), formatTTL(h))
	}
	return tw.Flush()
}

// runListing runs a listing command once its flags are parsed: it
// connects, reads the items under --prefix with list within
// --command-timeout, and prints them as JSON ([] when there are none) or
// with table (a note on stderr when there are none).
func runListing[T any](ctx context.Context, c *cmdFlags, asJSON bool, stdout, stderr io.Writer, noun string,
	list func(context.Context, *clientv3.Client, string, io.Writer) ([]T, error), table func(io.Writer, []T) error) error {
	var items []T
	err := c.conn.oneShot(ctx, func(rctx context.Context, cli *clientv3.Client) (err error) {
		if items, err = list(rctx, cli, c.conn.prefix, stderr); err != nil {
			return c.conn.explain(ctx, cli, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if asJSON {
		if items == nil {
			items = []T{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(items)
	}
	if len(items) == 0 {
		fmt.Fprintf(stderr, "coord: no %s under %s\n", noun, c.conn.prefix)
		return nil
	}
	return table(stdout, items)
}

// listHosts reads the hosts under prefix, sorted by UUID, with the state of
// their leases. It decodes them as coord's watcher does: the key names the
// host, the value is its HostMetadata JSON naming the same host.
func listHosts(ctx context.Context, cli *clientv3.Client, prefix string, stderr io.Writer) ([]liveHost, error) {
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list hosts under %s: %w", prefix, err)
	}
	var hosts []liveHost
	leases := map[int64]*clientv3.LeaseTimeToLiveResponse{}
	for _, kv := range resp.Kvs {
		key := string(kv.Key)
		id := strings.TrimPrefix(key, prefix)
		var m coord.HostMetadata
		switch err := json.Unmarshal(kv.Value, &m); {
		case id == "" || strings.Contains(id, "/"):
			fmt.Fprintf(stderr, "coord: skipping %s: not a host key\n", key)
			continue
		case err != nil:
			fmt.Fprintf(stderr, "coord: skipping %s: not host metadata: %v\n", key, err)
			continue
		case m.HostUUID != id:
			fmt.Fprintf(stderr, "coord: skipping %s: its value names host %q\n", key, m.HostUUID)
			continue
		}
		h := liveHost{HostMetadata: m, TTLLeft: -1}
		if kv.Lease != 0 {
			h.Lease = fmt.Sprintf("%x", kv.Lease)
			ttl, ok := leases[kv.Lease]
			if !ok {
				ttl, err = cli.TimeToLive(ctx, clientv3.LeaseID(kv.Lease))
				if err != nil {
					return nil, fmt.Errorf("read lease %x of host %s: %w", kv.Lease, id, err)
				}
				leases[kv.Lease] = ttl
			}
			h.TTLLeft, h.GrantedTTL = ttl.TTL, ttl.GrantedTTL
		}
		hosts = append(hosts, h)
	}
	return hosts, nil
}

func formatLabels(labels map[string]string) string {
	var b strings.Builder
	for i, k := range slices.Sorted(maps.Keys(labels)) {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k + "=" + labels[k])
	}
	return b.String()
}

func formatTTL(h liveHost) string {
	switch {
	case h.Lease == "":
		return "no lease"
	case h.TTLLeft < 0:
		return "expired"
	}
	return fmt.Sprintf("%v of %v", time.Duration(h.TTLLeft)*time.Second, time.Duration(h.GrantedTTL)*time.Second)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
