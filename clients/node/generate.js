#!/usr/bin/env node
// Generate or edit images through the GLM-Image GatewayService from Node.js.
//
// The .proto contracts are loaded at run time from protos/glmimage/v1 (no generated code), which is what proves
// they are language-neutral. Usage:
//
//   node generate.js --address 127.0.0.1:50050 --prompt "a red STOP sign" --size 256x256 --out out.png
//   node generate.js --image a.png --image b.png --prompt "make the sign blue" --size 256x256 --out edit.png
//   node generate.js --prompt "a red STOP sign" --lora tiny-style:0.8 --out styled.png
//   node generate.js --prompt "a red STOP sign" --priority batch --out later.png
//
// Each --image makes the call an edit: the file goes as it is, as one of the request's reference_images. Each
// --lora NAME[:SCALE] adds a LoRA adapter the denoiser runs with (the request's loras). --priority asks for a class
// within the tenant's share (glmimage.v1.Priority), up to its key's max_priority.
// Writes the image(s) and prints {"files", "width", "height", "seeds", "usage"} as JSON on stdout, with
// "rate_limits" (the x-ratelimit-* entries of the call's initial metadata) when the gateway sent them.
'use strict';

const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_DIR = path.join(PROTO_ROOT, 'glmimage', 'v1');

// Denoising steps extrapolated instead of computed (glmimage.v1.StepCache); unset means off.
const STEP_CACHE_LEVELS = ['off', 'balanced', 'aggressive'];
// Priority classes, highest first (glmimage.v1.Priority); unset means default.
const PRIORITIES = ['interactive', 'default', 'batch'];
// A tenant's quotas, as the gateway reports them with an admitted call (OpenAI's header names).
const RATE_LIMIT_KEYS = ['requests', 'images'].flatMap((kind) => ['limit', 'remaining', 'reset']
  .map((what) => `x-ratelimit-${what}-${kind}`));

// One --lora: NAME or NAME:SCALE (glmimage.v1.LoraRef). Adapter names never hold a ':'. Without SCALE the scale is
// left unset, so the adapter's own default applies (0 would switch it off); the gateway checks names and ranges.
function parseLora(text) {
  const at = text.indexOf(':');
  const name = at < 0 ? text : text.slice(0, at);
  const scale = at < 0 ? undefined : text.slice(at + 1);
  if (!name || (scale !== undefined && !/^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(scale))) {
    return usage(`--lora must be NAME[:SCALE], SCALE a number (e.g. tiny-style:0.8), got ${text}`);
  }
  return scale === undefined ? { name } : { name, scale: Number(scale) };
}

function usage(message) {
  if (message) console.error(`generate.js: ${message}`);
  (message ? console.error : console.log)('usage: node generate.js --prompt TEXT [--address HOST:PORT[,HOST:PORT...]] [--size WxH] [-n N] [--seed S]\n' +
    '                   [--steps K] [--step-cache off|balanced|aggressive] [--lora NAME[:SCALE] ...]\n' +
    '                   [--priority interactive|default|batch]\n' +
    '                   [--image REF.png ...] [--out FILE.png]\n' +
    '                   [--api-key KEY] [--timeout SECONDS]\n' +
    '                   [--tls-ca CA.pem [--tls-cert CERT.pem --tls-key KEY.pem]]');
  process.exit(message ? 2 : 0);
}

function parse() {
  let parsed;
  try {
    parsed = parseArgs({
      allowPositionals: true,
      options: {
        address: { type: 'string', default: process.env.GLMIMAGE_ADDRESS || '127.0.0.1:50050' },
        prompt: { type: 'string' },
        size: { type: 'string', default: '256x256' },
        n: { type: 'string', short: 'n', default: '1' },
        seed: { type: 'string' },
        steps: { type: 'string' },
        'step-cache': { type: 'string' },
        lora: { type: 'string', multiple: true },
        priority: { type: 'string' },
        image: { type: 'string', short: 'i', multiple: true },
        out: { type: 'string', short: 'o', default: 'out.png' },
        'api-key': { type: 'string', default: process.env.GLMIMAGE_API_KEY },
        timeout: { type: 'string', default: '600' },
        'tls-ca': { type: 'string' },
        'tls-cert': { type: 'string' },
        'tls-key': { type: 'string' },
        help: { type: 'boolean', short: 'h' },
      },
    });
  } catch (err) {
    usage(err.message);
  }
  const v = parsed.values;
  if (v.help) usage();
  const prompt = v.prompt ?? parsed.positionals.join(' ');
  if (!prompt) usage('a prompt is required');
  const size = /^(\d+)x(\d+)$/i.exec(v.size);
  if (!size) usage(`--size must look like 256x256, got ${v.size}`);
  if (v['step-cache'] !== undefined && !STEP_CACHE_LEVELS.includes(v['step-cache'])) {
    usage(`--step-cache must be one of ${STEP_CACHE_LEVELS.join(', ')}, got ${v['step-cache']}`);
  }
  if (v.priority !== undefined && !PRIORITIES.includes(v.priority)) {
    usage(`--priority must be one of ${PRIORITIES.join(', ')}, got ${v.priority}`);
  }
  const loras = (v.lora ?? []).map(parseLora);
  return { ...v, prompt, loras, width: Number(size[1]), height: Number(size[2]), n: Number(v.n), images: readImages(v.image ?? []) };
}

// An edit's reference files, read as they are (never decoded here); a file that cannot be read is a usage error.
function readImages(files) {
  return files.map((file) => {
    try {
      return fs.readFileSync(file);
    } catch (err) {
      return usage(`cannot read --image ${file}: ${err.message}`);
    }
  });
}

function loadGatewayService() {
  // Every .proto of the package, so imports between them resolve the same way as for protoc.
  const files = fs.readdirSync(PROTO_DIR).filter((f) => f.endsWith('.proto')).map((f) => path.join(PROTO_DIR, f));
  const definition = protoLoader.loadSync(files, {
    keepCase: true, // field names as in the .proto, so the usage JSON matches the other clients
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTO_ROOT],
  });
  return grpc.loadPackageDefinition(definition).glmimage.v1.GatewayService;
}

function credentials(args) {
  if (!args['tls-ca'] && !args['tls-cert']) return grpc.credentials.createInsecure();
  const read = (p) => (p ? fs.readFileSync(p) : null);
  return grpc.credentials.createSsl(read(args['tls-ca']), read(args['tls-key']), read(args['tls-cert']));
}

// Several gateways ("a:p,b:p", IP literals) become one ipv4:/ipv6: target, and such a target or a dns:///name:port
// gets grpc-js's round_robin, so calls spread over the gateways; the retry policy then sends a call that failed
// UNAVAILABLE (a gateway gone) to another one. One plain host:port is left as it is (pick_first, no retries).
const ROUND_ROBIN = {
  loadBalancingConfig: [{ round_robin: {} }],
  methodConfig: [{
    name: [{ service: 'glmimage.v1.GatewayService' }],
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

function outputPaths(out, n) {
  if (n === 1) return [out];
  const ext = path.extname(out) || '.png';
  const stem = out.slice(0, out.length - path.extname(out).length);
  return Array.from({ length: n }, (_, i) => `${stem}-${i}${ext}`);
}

function main() {
  const args = parse();
  const GatewayService = loadGatewayService();
  const { target, options } = balancedTarget(args.address);
  const client = new GatewayService(target, credentials(args), {
    'grpc.max_receive_message_length': 256 * 1024 * 1024,
    ...options,
  });
  const request = {
    prompt: args.prompt,
    n: args.n,
    height: args.height,
    width: args.width,
    output_format: 'IMAGE_FORMAT_PNG',
  };
  if (args.seed !== undefined) request.seed = Number(args.seed);
  if (args.steps !== undefined) request.num_inference_steps = Number(args.steps);
  if (args['step-cache'] !== undefined) request.step_cache = `STEP_CACHE_${args['step-cache'].toUpperCase()}`;
  request.loras = args.loras;
  if (args.priority !== undefined) request.priority = `PRIORITY_${args.priority.toUpperCase()}`;
  // Reference images make it an edit (bytes fields take Buffers); the gateway checks their headers.
  request.reference_images = args.images.map((data) => ({ data }));
  const metadata = new grpc.Metadata();
  if (args['api-key']) metadata.set('authorization', `Bearer ${args['api-key']}`);
  const deadline = new Date(Date.now() + Number(args.timeout) * 1000);

  let rateLimits = null;
  const call = client.GenerateImages(request, metadata, { deadline }, (err, response) => {
    client.close();
    if (err) {
      console.error(`generate.js: ${grpc.status[err.code] ?? err.code}: ${err.details || err.message}`);
      process.exit(1);
    }
    const images = [...response.images].sort((a, b) => a.index - b.index);
    const files = outputPaths(args.out, images.length);
    images.forEach((image, i) => {
      fs.mkdirSync(path.dirname(path.resolve(files[i])), { recursive: true });
      fs.writeFileSync(files[i], image.image);
    });
    console.log(JSON.stringify({
      files,
      width: response.width,
      height: response.height,
      seeds: images.map((image) => image.seed),
      request_id: response.request_id,
      usage: response.usage,
      ...(rateLimits ? { rate_limits: rateLimits } : {}),
    }, null, 2));
  });
  // The initial metadata arrives before the response, so this runs before the callback above.
  call.on('metadata', (md) => {
    const found = RATE_LIMIT_KEYS.filter((key) => md.get(key).length > 0);
    if (found.length > 0) rateLimits = Object.fromEntries(found.map((key) => [key, String(md.get(key)[0])]));
  });
}

main();
