// What generate.js and jobs.js share: the contracts loaded at run time from protos/glmimage/v1 (no generated code),
// the channel (plaintext or TLS, one gateway or several round robin) and the key's metadata.
'use strict';

const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_DIR = path.join(PROTO_ROOT, 'glmimage', 'v1');

// The glmimage.v1 package: every .proto of it, so imports between them resolve the same way as for protoc.
function loadPackage() {
  const files = fs.readdirSync(PROTO_DIR).filter((f) => f.endsWith('.proto')).map((f) => path.join(PROTO_DIR, f));
  const definition = protoLoader.loadSync(files, {
    keepCase: true, // field names as in the .proto, so the JSON printed matches the other clients
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTO_ROOT],
  });
  return grpc.loadPackageDefinition(definition).glmimage.v1;
}

function credentials(args) {
  if (!args['tls-ca'] && !args['tls-cert']) return grpc.credentials.createInsecure();
  const read = (p) => (p ? fs.readFileSync(p) : null);
  return grpc.credentials.createSsl(read(args['tls-ca']), read(args['tls-key']), read(args['tls-cert']));
}

// Several gateways ("a:p,b:p", IP literals) become one ipv4:/ipv6: target, and such a target or a dns:///name:port
// gets grpc-js's round_robin, so calls spread over the gateways; the retry policy then sends a call that failed
// UNAVAILABLE (a gateway gone) to another one. One plain host:port is left as it is (pick_first, no retries).
// JobService is named too: a retried SubmitJob carries its idempotency key, so it never makes a second job.
const ROUND_ROBIN = {
  loadBalancingConfig: [{ round_robin: {} }],
  methodConfig: [{
    name: [{ service: 'glmimage.v1.GatewayService' }, { service: 'glmimage.v1.JobService' }],
    retryPolicy: {
      maxAttempts: 4, initialBackoff: '0.2s', maxBackoff: '5s', backoffMultiplier: 2,
      retryableStatusCodes: ['UNAVAILABLE'],
    },
  }],
};

function balancedTarget(address) {
  const scheme = /^(dns|ipv4|ipv6|unix|xds):/;
  const addrs = scheme.test(address.trim())
    ? [address.trim()]
    : address.split(',').map((a) => a.trim()).filter(Boolean);
  if (addrs.length === 0) throw new Error(`no gateway address in ${JSON.stringify(address)}`);
  let target = addrs[0];
  if (addrs.length > 1) {
    const family = (a) => net.isIP(a.replace(/:\d+$/, '').replace(/^\[|\]$/g, ''));
    const families = new Set(addrs.map(family));
    if (families.size !== 1 || families.has(0)) {
      throw new Error(`several addresses must all be IPv4 or all IPv6 host:port literals, not ${addrs}; ` +
        'for a name resolving to several gateways give one dns:///name:port');
    }
    target = `ipv${[...families][0]}:${addrs.join(',')}`;
  }
  const balanced = /^(dns|ipv4|ipv6):/.test(target);
  return { target, options: balanced ? { 'grpc.service_config': JSON.stringify(ROUND_ROBIN) } : {} };
}

// A client of `Service` (a constructor from loadPackage()) for the parsed --address and TLS flags.
function connect(Service, args) {
  const { target, options } = balancedTarget(args.address);
  return new Service(target, credentials(args), {
    'grpc.max_receive_message_length': 256 * 1024 * 1024,
    ...options,
  });
}

function metadataFor(apiKey) {
  const metadata = new grpc.Metadata();
  if (apiKey) metadata.set('authorization', `Bearer ${apiKey}`);
  return metadata;
}

// The connection flags of every script, for node:util parseArgs.
const CONNECTION_OPTIONS = {
  address: { type: 'string', default: process.env.GLMIMAGE_ADDRESS || '127.0.0.1:50050' },
  'api-key': { type: 'string', default: process.env.GLMIMAGE_API_KEY },
  timeout: { type: 'string', default: '600' },
  'tls-ca': { type: 'string' },
  'tls-cert': { type: 'string' },
  'tls-key': { type: 'string' },
};

module.exports = { CONNECTION_OPTIONS, balancedTarget, connect, credentials, grpc, loadPackage, metadataFor };
