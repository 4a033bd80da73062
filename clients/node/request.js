// The generation flags generate.js and jobs.js share, and the glmimage.v1.GenerateImagesRequest they make.
'use strict';

const fs = require('node:fs');

// Denoising steps extrapolated instead of computed (glmimage.v1.StepCache); unset means off.
const STEP_CACHE_LEVELS = ['off', 'balanced', 'aggressive'];
// Priority classes, highest first (glmimage.v1.Priority); unset means default.
const PRIORITIES = ['interactive', 'default', 'batch'];

// For node:util parseArgs.
const GENERATION_OPTIONS = {
  prompt: { type: 'string' },
  size: { type: 'string', default: '256x256' },
  n: { type: 'string', short: 'n', default: '1' },
  seed: { type: 'string' },
  steps: { type: 'string' },
  'step-cache': { type: 'string' },
  lora: { type: 'string', multiple: true },
  priority: { type: 'string' },
  image: { type: 'string', short: 'i', multiple: true },
};

// One --lora: NAME or NAME:SCALE (glmimage.v1.LoraRef). Adapter names never hold a ':'. Without SCALE the scale is
// left unset, so the adapter's own default applies (0 would switch it off); the gateway checks names and ranges.
function parseLora(text, fail) {
  const at = text.indexOf(':');
  const name = at < 0 ? text : text.slice(0, at);
  const scale = at < 0 ? undefined : text.slice(at + 1);
  if (!name || (scale !== undefined && !/^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(scale))) {
    return fail(`--lora must be NAME[:SCALE], SCALE a number (e.g. tiny-style:0.8), got ${text}`);
  }
  return scale === undefined ? { name } : { name, scale: Number(scale) };
}

// An edit's reference files, read as they are (never decoded here); a file that cannot be read is a usage error.
function readImages(files, fail) {
  return files.map((file) => {
    try {
      return fs.readFileSync(file);
    } catch (err) {
      return fail(`cannot read --image ${file}: ${err.message}`);
    }
  });
}

// The request of the parsed flags `v` (the prompt from --prompt, else the positionals); `fail(message)` reports a
// usage error (and exits).
function generationRequest(v, positionals, fail) {
  const prompt = v.prompt ?? positionals.join(' ');
  if (!prompt) fail('a prompt is required');
  const size = /^(\d+)x(\d+)$/i.exec(v.size);
  if (!size) fail(`--size must look like 256x256, got ${v.size}`);
  if (v['step-cache'] !== undefined && !STEP_CACHE_LEVELS.includes(v['step-cache'])) {
    fail(`--step-cache must be one of ${STEP_CACHE_LEVELS.join(', ')}, got ${v['step-cache']}`);
  }
  if (v.priority !== undefined && !PRIORITIES.includes(v.priority)) {
    fail(`--priority must be one of ${PRIORITIES.join(', ')}, got ${v.priority}`);
  }
  const request = {
    prompt,
    n: Number(v.n),
    width: Number(size[1]),
    height: Number(size[2]),
    output_format: 'IMAGE_FORMAT_PNG',
    loras: (v.lora ?? []).map((text) => parseLora(text, fail)),
    // Reference images make it an edit (bytes fields take Buffers); the gateway checks their headers.
    reference_images: readImages(v.image ?? [], fail).map((data) => ({ data })),
  };
  if (v.seed !== undefined) request.seed = Number(v.seed);
  if (v.steps !== undefined) request.num_inference_steps = Number(v.steps);
  if (v['step-cache'] !== undefined) request.step_cache = `STEP_CACHE_${v['step-cache'].toUpperCase()}`;
  if (v.priority !== undefined) request.priority = `PRIORITY_${v.priority.toUpperCase()}`;
  return request;
}

module.exports = { GENERATION_OPTIONS, PRIORITIES, STEP_CACHE_LEVELS, generationRequest };
