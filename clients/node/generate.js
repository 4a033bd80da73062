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
const path = require('node:path');
const { parseArgs } = require('node:util');
const { CONNECTION_OPTIONS, connect, grpc, loadPackage, metadataFor } = require('./connect');
const { GENERATION_OPTIONS, generationRequest } = require('./request');

// A tenant's quotas, as the gateway reports them with an admitted call (OpenAI's header names).
const RATE_LIMIT_KEYS = ['requests', 'images'].flatMap((kind) => ['limit', 'remaining', 'reset']
  .map((what) => `x-ratelimit-${what}-${kind}`));

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
        ...CONNECTION_OPTIONS,
        ...GENERATION_OPTIONS,
        out: { type: 'string', short: 'o', default: 'out.png' },
        help: { type: 'boolean', short: 'h' },
      },
    });
  } catch (err) {
    usage(err.message);
  }
  const v = parsed.values;
  if (v.help) usage();
  return { ...v, request: generationRequest(v, parsed.positionals, usage) };
}

function outputPaths(out, n) {
  if (n === 1) return [out];
  const ext = path.extname(out) || '.png';
  const stem = out.slice(0, out.length - path.extname(out).length);
  return Array.from({ length: n }, (_, i) => `${stem}-${i}${ext}`);
}

function main() {
  const args = parse();
  const client = connect(loadPackage().GatewayService, args);
  const { request } = args;
  const metadata = metadataFor(args['api-key']);
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
