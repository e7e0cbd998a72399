// Assigns addresses with Calico's own IPAM client, as the CNI plugin and
// calico-node do, for dphandler's tests (calicoctl has no command that
// assigns): the address's block is claimed with affinity to the host if it
// has no block yet, so Felix routes the block to that host.
//
//	DATASTORE_TYPE=etcdv3 ETCD_ENDPOINTS=... ipam assign <ip> <host> <handle> [workload|tunnel]
package main

import (
	"context"
	"fmt"
	"os"

	v3 "github.com/projectcalico/api/pkg/apis/projectcalico/v3"
	"github.com/projectcalico/calico/libcalico-go/lib/apiconfig"
	"github.com/projectcalico/calico/libcalico-go/lib/clientv3"
	"github.com/projectcalico/calico/libcalico-go/lib/ipam"
	cnet "github.com/projectcalico/calico/libcalico-go/lib/net"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "ipam: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 5 || os.Args[1] != "assign" {
		fail("usage: ipam assign <ip> <host> <handle> [workload|tunnel]")
	}
	ip := cnet.ParseIP(os.Args[2])
	if ip == nil {
		fail("%q is not an IP address", os.Args[2])
	}
	use := v3.IPPoolAllowedUseWorkload
	if len(os.Args) > 5 && os.Args[5] == "tunnel" {
		use = v3.IPPoolAllowedUseTunnel
	}
	cfg, err := apiconfig.LoadClientConfigFromEnvironment()
	if err != nil {
		fail("datastore settings: %v", err)
	}
	c, err := clientv3.New(*cfg)
	if err != nil {
		fail("datastore client: %v", err)
	}
	handle := os.Args[4]
	err = c.IPAM().AssignIP(context.Background(), ipam.AssignIPArgs{
		IP:          *ip,
		HandleID:    &handle,
		Hostname:    os.Args[3],
		IntendedUse: use,
	})
	if err != nil {
		fail("assigning %s to %s: %v", os.Args[2], os.Args[3], err)
	}
}
