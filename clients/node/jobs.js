#!/usr/bin/env node
// Jobs through the GLM-Image JobService from Node.js: generations that outlive the connection that made them.
//
//   node jobs.js submit --prompt "a red STOP sign" --size 256x256 -n 2 --seed 7 [--wait] [--out DIR]
//   node jobs.js submit --prompt "the cat in a hat" --image cat.png --size 256x256 --webhook-url https://hooks/x
//   node jobs.js get ID
//   node jobs.js wait ID [--timeout SECONDS] [--out DIR]
//   node jobs.js cancel ID
//   node jobs.js list [--limit N] [--after ID] [--status queued|in_progress|completed|failed|cancelled] [--all]
//   node jobs.js webhook-secret
//
// Prints the job (list: {"jobs", "has_more"}) as JSON on stdout, in the Python SDK's Job.as_dict() shape; with --out
// also "files", the images written as DIR/image-<i>.<ext> (their bytes fetched over gRPC, GetJob include_images).
// wait follows WatchJob, drawing the progress on stderr, and watches again with backoff when the stream breaks
// (UNAVAILABLE: a gateway restarted, a connection cut): the job goes on without it. Exit code 0 for a completed (or
// listed, cancelled-on-request) job, 1 for a failed or cancelled job waited for, a gRPC error or a wait past
// --timeout, 2 for bad arguments.
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const { CONNECTION_OPTIONS, connect, grpc, loadPackage, metadataFor } = require('./connect');
const { GENERATION_OPTIONS, generationRequest } = require('./request');

const STATUSES = ['queued', 'in_progress', 'completed', 'failed', 'cancelled'];
const TERMINAL = new Set(['completed', 'failed', 'cancelled']);
const EXTENSIONS = { png: 'png', jpeg: 'jpg', webp: 'webp' };
// A wait reconnects on these (the SDK's rule): the job does not depend on the stream.
const REWATCH_CODES = new Set([grpc.status.UNAVAILABLE, grpc.status.RESOURCE_EXHAUSTED]);
const OUT_OPTIONS = {
  out: { type: 'string', short: 'o' },
  name: { type: 'string', default: 'image' },
};
const VERBS = {
  submit: {
    ...GENERATION_OPTIONS, ...OUT_OPTIONS,
    'webhook-url': { type: 'string' },
    'idempotency-key': { type: 'string' },
    wait: { type: 'boolean' },
  },
  get: {},
  wait: { ...OUT_OPTIONS },
  cancel: {},
  list: { limit: { type: 'string', default: '20' }, after: { type: 'string' }, status: { type: 'string' },
    all: { type: 'boolean' } },
  'webhook-secret': {},
};

function usage(message) {
  if (message) console.error(`jobs.js: ${message}`);
  (message ? console.error : console.log)(
    'usage: node jobs.js submit --prompt TEXT [--size WxH] [-n N] [--seed S] [--steps K] [--step-cache LEVEL]\n' +
    '                           [--lora NAME[:SCALE] ...] [--priority CLASS] [--image REF.png ...]\n' +
    '                           [--webhook-url URL] [--idempotency-key KEY] [--wait] [--out DIR] [--name STEM]\n' +
    '       node jobs.js get ID\n' +
    '       node jobs.js wait ID [--out DIR] [--name STEM]\n' +
    '       node jobs.js cancel ID\n' +
    '       node jobs.js list [--limit N] [--after ID] [--status STATUS] [--all]\n' +
    '       node jobs.js webhook-secret\n' +
    'every verb: [--address HOST:PORT[,HOST:PORT...]] [--api-key KEY] [--timeout SECONDS]\n' +
    '            [--tls-ca CA.pem [--tls-cert CERT.pem --tls-key KEY.pem]]');
  process.exit(message ? 2 : 0);
}

function parse() {
  const [verb, ...rest] = process.argv.slice(2);
  if (verb === undefined) usage('a verb is required');
  if (verb === '--help' || verb === '-h') usage();
  if (!(verb in VERBS)) usage(`unknown verb ${verb}: one of ${Object.keys(VERBS).join(', ')}`);
  let parsed;
  try {
    parsed = parseArgs({
      args: rest,
      allowPositionals: true,
      options: { ...CONNECTION_OPTIONS, ...VERBS[verb], help: { type: 'boolean', short: 'h' } },
    });
  } catch (err) {
    usage(err.message);
  }
  const v = parsed.values;
  if (v.help) usage();
  const args = { ...v, verb, timeoutS: Number(v.timeout) };
  if (!(args.timeoutS > 0)) usage(`--timeout must be a number of seconds, got ${v.timeout}`);
  if (verb === 'submit') {
    args.request = generationRequest(v, parsed.positionals, usage);
  } else if (['get', 'wait', 'cancel'].includes(verb)) {
    if (parsed.positionals.length !== 1) usage(`${verb} takes one job id`);
    [args.id] = parsed.positionals;
  } else if (parsed.positionals.length > 0) {
    usage(`${verb} takes no ${parsed.positionals.join(' ')}`);
  }
  if (verb === 'list') {
    args.limitN = Number(v.limit);
    if (!Number.isInteger(args.limitN) || args.limitN < 1 || args.limitN > 100) {
      usage(`--limit must be 1 to 100, got ${v.limit}`);
    }
    if (v.status !== undefined && !STATUSES.includes(v.status)) {
      usage(`--status must be one of ${STATUSES.join(', ')}, got ${v.status}`);
    }
  }
  return args;
}

// --- jobs as JSON: the Python SDK's Job.as_dict() ------------------------------------------------------------------

const statusName = (s) => String(s).replace(/^JOB_STATUS_/, '').toLowerCase();
const formatName = (f) => ({ IMAGE_FORMAT_JPEG: 'jpeg', IMAGE_FORMAT_WEBP: 'webp' }[f] ?? 'png');
const orNull = (seconds) => (seconds ? seconds : null); // 0 on the wire: not yet

function jobJson(job) {
  const result = job.result ?? null;
  const images = result ? [...result.images].sort((a, b) => a.index - b.index) : [];
  const error = job.error && (job.error.code || job.error.message) ? job.error : null;
  return {
    id: job.id,
    status: statusName(job.status),
    created_at: job.created_at,
    started_at: orNull(job.started_at),
    finished_at: orNull(job.finished_at),
    expires_at: orNull(job.expires_at),
    progress: {
      queue_position: job.progress?.queue_position ?? 0,
      step: job.progress?.step ?? 0,
      total_steps: job.progress?.total_steps ?? 0,
    },
    images: images.map((im) => ({
      index: im.index, seed: im.seed, url: im.url, url_expires_at: orNull(im.url_expires_at),
    })),
    error: error ? { code: error.code, message: error.message, field: error.field } : null,
    attempts: job.attempts,
    webhook_url: job.webhook_url,
    request_id: job.request_id || (result ? result.request_id : ''),
    n: job.n,
    edit: job.edit,
    width: result ? result.width : 0,
    height: result ? result.height : 0,
    output_format: result ? formatName(result.output_format) : null,
    usage: result ? result.usage : null,
  };
}

// --- calls ---------------------------------------------------------------------------------------------------------

class Failure extends Error {} // printed as it is, exit code 1

function describe(err, id) {
  if (err instanceof Failure) return err.message;
  // Another tenant's job answers as one that never existed: the message cannot tell them apart either.
  if (err.code === grpc.status.NOT_FOUND && id) return `no such job (or not yours): ${id}`;
  return `${grpc.status[err.code] ?? err.code}: ${err.details || err.message}`;
}

function unary(client, method, request, metadata, timeoutS) {
  const deadline = new Date(Date.now() + timeoutS * 1000);
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

const sleep = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

// One line on stderr redrawn at each update: the queue position, then a bar over the job's steps.
function progressLine() {
  let drawn = 0;
  return {
    update(job) {
      const p = job.progress;
      let text;
      if (job.status === 'in_progress' && p.total_steps) {
        const frac = p.step / p.total_steps;
        const filled = Math.round(frac * 30);
        text = `[${'#'.repeat(filled)}${'-'.repeat(30 - filled)}] ${String(Math.round(frac * 100)).padStart(3)}%  ` +
          `${p.step}/${p.total_steps} steps`;
      } else {
        text = `${job.id} ${job.status}` +
          (job.status === 'queued' && p.queue_position ? `, queue position ${p.queue_position}` : '');
      }
      process.stderr.write(`\r${text.padEnd(drawn)}`);
      drawn = text.length;
    },
    finish() {
      if (drawn) process.stderr.write('\n');
    },
  };
}

// One WatchJob stream: resolves {job} at the job's end, or {broken: status, received: messages} when the stream
// ends before it; `onJob` sees each new state.
function watchOnce(client, id, metadata, deadline, onJob) {
  return new Promise((resolve) => {
    const call = client.WatchJob({ id }, metadata, { deadline });
    let ended = null;
    let received = 0;
    call.on('data', (msg) => {
      received += 1;
      const job = jobJson(msg.job);
      onJob(job);
      if (TERMINAL.has(job.status) && ended === null) {
        ended = job;
        call.cancel(); // the stream ends after the job's end anyway; nothing more is needed from it
      }
    });
    call.on('error', () => {}); // the status below says it all
    call.on('status', (status) => resolve(ended ? { job: ended } : { broken: status, received }));
  });
}

// Follows the job to its end, watching again with backoff (jittered, capped at 5 s) when the stream breaks.
async function wait(client, id, metadata, timeoutS, first) {
  const deadline = Date.now() + timeoutS * 1000;
  const line = progressLine();
  let last = first ? JSON.stringify(first) : null;
  let seen = first ?? null;
  if (first) line.update(first);
  const onJob = (job) => {
    const text = JSON.stringify({ ...job, images: job.images.map(({ index, seed }) => ({ index, seed })) });
    if (text !== last) line.update(job);
    last = text;
    seen = job;
  };
  try {
    if (first && TERMINAL.has(first.status)) return first;
    let failures = 0; // in a row, without a message: the backoff's exponent
    for (;;) {
      const outcome = await watchOnce(client, id, metadata, new Date(deadline), onJob);
      if (outcome.job) return outcome.job;
      const { code, details } = outcome.broken;
      failures = outcome.received > 0 ? 0 : failures + 1;
      const timedOut = () => new Failure(`job ${id} still ${seen ? seen.status : 'not seen'} after ${timeoutS}s; ` +
        'it goes on: wait again, or cancel it');
      if (code === grpc.status.DEADLINE_EXCEEDED && Date.now() >= deadline - 500) throw timedOut();
      if (code !== grpc.status.OK && !REWATCH_CODES.has(code)) {
        throw Object.assign(new Error(details), { code, details });
      }
      const delay = Math.min(5000, 200 * 2 ** Math.max(0, failures - 1)) * (1 - 0.5 * Math.random());
      if (Date.now() + delay >= deadline) throw timedOut();
      process.stderr.write(`\rjobs.js: watch ended (${grpc.status[code]}: ${details}); watching again\n`);
      await sleep(delay);
    }
  } finally {
    line.finish();
  }
}

async function writeImages(client, job, args, metadata) {
  const full = await unary(client, 'GetJob', { id: job.id, include_images: true }, metadata, args.timeoutS);
  const images = [...full.job.result.images].sort((a, b) => a.index - b.index);
  const ext = EXTENSIONS[formatName(full.job.result.output_format)];
  fs.mkdirSync(args.out, { recursive: true });
  return images.map((im, i) => {
    const file = path.join(args.out, `${args.name}-${i}.${ext}`);
    fs.writeFileSync(file, im.image);
    return file;
  });
}

// An ended job: printed (with the files written under --out); a failed or cancelled one is exit code 1.
async function reportEnd(client, job, args, metadata) {
  const wanted = job.status === 'completed' && args.out !== undefined;
  const files = wanted ? await writeImages(client, job, args, metadata) : [];
  console.log(JSON.stringify({ ...job, files }, null, 2));
  if (job.status === 'failed') {
    const e = job.error ?? { code: '', message: 'no reason given', field: '' };
    throw new Failure(`job ${job.id} failed: ${e.code}: ${e.field ? `${e.field}: ` : ''}${e.message}`);
  }
  if (job.status === 'cancelled') throw new Failure(`job ${job.id} was cancelled`);
}

async function run(args, client) {
  const metadata = metadataFor(args['api-key']);
  const call = (method, request) => unary(client, method, request, metadata, args.timeoutS);
  const print = (value) => console.log(JSON.stringify(value, null, 2));
  switch (args.verb) {
    case 'submit': {
      const { job } = await call('SubmitJob', {
        request: args.request,
        webhook_url: args['webhook-url'] ?? '',
        // A fresh key per run when none is given, so a retry of this submit never makes a second job.
        idempotency_key: args['idempotency-key'] ?? `node-${crypto.randomUUID()}`,
      });
      const submitted = jobJson(job);
      if (!args.wait && args.out === undefined) return print(submitted);
      process.stderr.write(`jobs.js: submitted ${submitted.id}\n`);
      return reportEnd(client, await wait(client, submitted.id, metadata, args.timeoutS, submitted), args, metadata);
    }
    case 'wait':
      return reportEnd(client, await wait(client, args.id, metadata, args.timeoutS, null), args, metadata);
    case 'get':
      return print(jobJson((await call('GetJob', { id: args.id })).job));
    case 'cancel':
      return print(jobJson((await call('CancelJob', { id: args.id })).job));
    case 'list': {
      const status = args.status ? `JOB_STATUS_${args.status.toUpperCase()}` : 'JOB_STATUS_UNSPECIFIED';
      const jobs = [];
      let after = args.after ?? '';
      for (;;) {
        const page = await call('ListJobs', { limit: args.limitN, after, status });
        jobs.push(...page.jobs.map(jobJson));
        if (!args.all || !page.has_more || page.jobs.length === 0) {
          return print({ jobs, has_more: args.all ? false : page.has_more });
        }
        after = page.jobs[page.jobs.length - 1].id;
      }
    }
    case 'webhook-secret':
      return print({ secret: (await call('GetWebhookSecret', {})).secret });
    default:
      return usage(`unknown verb ${args.verb}`);
  }
}

async function main() {
  const args = parse();
  const client = connect(loadPackage().JobService, args);
  try {
    await run(args, client);
  } catch (err) {
    console.error(`jobs.js: ${describe(err, args.id)}`);
    process.exitCode = 1;
  } finally {
    client.close();
  }
}

main();
