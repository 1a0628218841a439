/**
 * The `shoal` command table. One entry per command; each command's code is imported lazily from
 * `scripts/commands/<name>.ts` so `shoal ca list` never loads onnxruntime or libp2p.
 * Only this file decides exit codes: commands return normally or throw an ExitError.
 */
import { Command, CommanderError, Option } from 'commander'
import { isExitError } from './exit-error.ts'
import pkg from '../package.json' with { type: 'json' }

function collect (value: string, previous: string[]): string[] {
  return [...previous, value]
}

/** A flag given any number of times; `shown` is what --help says the default is. */
function repeatable (flags: string, description: string, shown: string): Option {
  return new Option(flags, description).argParser(collect).default([], shown)
}

/**
 * Required options are checked after unknown ones, unlike commander's requiredOption: a mistyped
 * `--modle x` must be reported as the unknown option it is, not as a missing `--model`.
 */
const REQUIRED = new WeakSet<Option>()
function required (flags: string, description: string): Option {
  const option = new Option(flags, `${description} (required)`)
  REQUIRED.add(option)
  return option
}

function logFormat (): Option {
  return new Option('--log-format <format>', 'logs on stderr: human lines, or JSON lines (default: human on a terminal, else json)').choices(['human', 'json'])
}

function kernelsOption (): Option {
  return new Option('--kernels <which>', "int4 products and one-position attention on shoal's own kernels, built here with the C compiler (auto: where they build and pass their self-check) or on onnxruntime's").choices(['auto', 'onnxruntime']).default('auto')
}

export function buildProgram (): Command {
  const program = new Command('shoal')
    .description('A private inference mesh: one daemon per machine, any OpenAI client, any node.')
    .version(pkg.version, '-V, --version', 'print the version')
    .showHelpAfterError(false)
    .exitOverride()
    .configureOutput({ outputError: () => { /* main prints the one-line reason */ } })
  // Runs after commander's unknown-option check and before the action.
  program.hook('preAction', (_program, command) => {
    for (const option of command.options) {
      if (REQUIRED.has(option) && command.getOptionValue(option.attributeName()) === undefined) {
        command.error(`required option '${option.flags}' not specified`, { code: 'commander.missingMandatoryOptionValue', exitCode: 2 })
      }
    }
  })

  program.command('demo')
    .description('Start a local mesh of N daemons on loopback with a throwaway CA and the built-in demo model')
    .option('--nodes <n>', 'number of daemons', '3')
    .option('--port <port>', 'API port of the first node', '8080')
    .addOption(logFormat())
    .action(async (opts) => { await (await import('./commands/demo.ts')).demo(opts) })

  program.command('serve')
    .description('Serve one model on this machine, no mesh (HF checkpoint or shard directory; a multi-stage one runs as a local chain)')
    .addOption(required('--model <dir>', 'model directory'))
    .option('--api <host:port>', 'HTTP listen address', '127.0.0.1:8080')
    .option('--device <device>', 'engine device: cpu, or an OpenVINO device (CPU, GPU, NPU, AUTO); for a multi-stage shard directory, one per stage (cpu,GPU,NPU)', 'auto')
    .option('--data <dir>', 'receipt log and node key (default: the cache directory\'s serve/)')
    .option('--kv-cache-mb <n>', 'MiB of KV kept from finished requests for prefix reuse; 0: none (default: an eighth of free memory, 64–2048)')
    .addOption(logFormat())
    .option('--require-keys', 'accept only client keys issued by the CA given with --ca (`shoal ca key`)')
    .option('--ca <file>', 'CA certificate (ca.cert.json) that client keys must chain to')
    .option('--revocations <file>', 'CA revocation list withdrawing client keys (read at start)')
    .option('--tls-cert <file>', 'HTTPS: PEM certificate (chain) for the API')
    .option('--tls-key <file>', 'HTTPS: PEM private key of --tls-cert')
    .option('--draft <dir>', 'speculative decoding: a draft model directory with the same tokenizer, "lookup" (prompt lookup, no model) or "none" (default: prompt lookup on models with f32 activations, for greedy and unseeded requests)')
    .addOption(kernelsOption())
    .action(async (opts) => { await (await import('./commands/serve.ts')).serve(opts) })

  program.command('node')
    .description('Run the mesh daemon')
    .addOption(required('--identity <dir>', 'identity directory made by `shoal ca issue`'))
    .addOption(repeatable('--model <dir[@layers]>', 'model or shard directory, optionally one stage (@0-11); repeatable', 'none'))
    .addOption(repeatable('--listen <multiaddr>', 'listen address; repeatable', 'QUIC and TCP on all interfaces, ephemeral ports'))
    .addOption(repeatable('--announce <multiaddr>', 'address peers are told to dial instead of the listen addresses (a NAT or relay in front); repeatable', 'the listen addresses'))
    .addOption(repeatable('--bootstrap <multiaddr>', 'peer to dial at start; repeatable', 'none; mDNS finds LAN peers'))
    .option('--api <host:port>', 'HTTP ingress address (none without it)')
    .option('--device <device>', 'engine device', 'auto')
    .option('--data <dir>', 'receipt log and node state (default: IDENTITY/data)')
    .option('--revocations <file>', 'CA revocation list')
    .option('--require-keys', 'the ingress accepts only client keys issued by the CA (`shoal ca key`)')
    .option('--tls-cert <file>', 'HTTPS: PEM certificate (chain) for the API')
    .option('--tls-key <file>', 'HTTPS: PEM private key of --tls-cert')
    .option('--kv-cache-mb <n>', 'MiB of KV kept from finished requests for prefix reuse; 0: none (default: an eighth of free memory, 64–2048)')
    .option('--no-mdns', 'disable LAN discovery')
    .addOption(logFormat())
    .option('--draft <dir>', 'speculative decoding for whole models served here: a draft model directory with the same tokenizer, "lookup" or "none" (default: prompt lookup on whole models with f32 activations, for greedy and unseeded requests)')
    .option('--hold-experts <dir>', 'be an expert holder: keep experts of this expert-parallel shard directory (shoal shard --experts) resident for stage nodes')
    .option('--expert-memory-mb <n>', 'MiB an expert holder keeps experts in (default: every expert of --hold-experts)')
    .addOption(kernelsOption())
    .addOption(new Option('--activations <encoding>', 'how the pipeline chains coordinated here send activations between stages: f32 (exact), f16 or int8 (lossy, for slow links)').choices(['f32', 'f16', 'int8']).default('f32'))
    .action(async (opts) => { await (await import('./commands/node.ts')).node(opts) })

  const ca = program.command('ca').description('Operator certificate authority')
  ca.command('init')
    .description('Create an operator CA (ed25519); refuses to overwrite')
    .addOption(required('--dir <dir>', 'CA directory'))
    .action(async (opts) => { await (await import('./commands/ca.ts')).caInit(opts) })
  ca.command('issue')
    .description('Create a node identity and its CA-signed certificate; prints the peer id')
    .addOption(required('--dir <dir>', 'CA directory'))
    .addOption(required('--name <name>', 'node name'))
    .addOption(required('--out <dir>', 'identity directory to create'))
    .option('--days <n>', 'validity in days', '365')
    .option('--roles <roles>', 'comma-separated: ingress,worker', 'ingress,worker')
    .action(async (opts) => { await (await import('./commands/ca.ts')).caIssue(opts) })
  ca.command('revoke')
    .description("Add a node's certificate to the CA's signed revocation list")
    .addOption(required('--dir <dir>', 'CA directory'))
    .addOption(required('--name <name>', 'node name'))
    .action(async (opts) => { await (await import('./commands/ca.ts')).caRevoke(opts) })
  ca.command('key')
    .description('Issue a client API key (a bearer token every node verifies offline; revocable like a certificate); prints it on the last line')
    .addOption(required('--dir <dir>', 'CA directory'))
    .addOption(required('--name <name>', 'key name (recorded in the receipts of its requests)'))
    .option('--days <n>', 'validity in days', '365')
    .action(async (opts) => { await (await import('./commands/ca.ts')).caKey(opts) })
  ca.command('list')
    .description('Name, peer id, serial, roles, expiry, revoked')
    .addOption(required('--dir <dir>', 'CA directory'))
    .action(async (opts) => { await (await import('./commands/ca.ts')).caList(opts) })

  program.command('shard')
    .description('Compile a checkpoint into per-stage shards and a manifest')
    .addOption(required('--model <dir>', 'Hugging Face checkpoint directory'))
    .addOption(required('--out <dir>', 'shard directory to write'))
    .option('--stages <n>', 'split evenly into N stages')
    .option('--layers <ranges>', 'explicit split, e.g. 0-11,12-23')
    .addOption(new Option('--quant <kind>', 'weight quantization').choices(['none', 'int8', 'int4']).default('none'))
    .option('--f32-activations', 'with --quant: f32 activations (closer to the unquantized model, slower per step)')
    .option('--f32-embedding', 'with --quant int4: keep the token embedding f32 (default: 4-bit blocks, an eighth of the bytes)')
    .addOption(new Option('--ops <table>', "op table: ort-contrib (onnxruntime's fused CPU kernels) or standard (portable opset-17 ONNX)").choices(['ort-contrib', 'standard']).default('ort-contrib'))
    .option('--static <ctx[,chunk]>', 'also write fixed-shape graphs for NPUs: KV budget CTX, prefill chunk CHUNK (default 128)')
    .option('--experts', 'mixture-of-experts checkpoints: expert-parallel shards (attention and router for a stage node, one graph per expert for holders) instead of stages')
    .option('--force', 'replace --out if it already exists')
    .action(async (opts) => { await (await import('./commands/shard.ts')).shard(opts) })

  const receipts = program.command('receipts').description('Signed receipts and the hash-chained log')
  receipts.command('verify')
    .description('Check every signature and the whole hash chain (a running node\'s log: a copy taken now)')
    .addOption(required('--data <dir>', 'data directory'))
    .option('--ca <file>', "also require every signer to hold a certificate from this CA (ca.cert.json) valid at each receipt's time; revocation is not checked")
    .option('--heads <file>', "also check the log against the heads its signer handed to peers (a peer's DATA/witnessed-heads.json); repeatable", collect, [])
    .action(async (opts) => { await (await import('./commands/receipts.ts')).receiptsVerify(opts) })
  receipts.command('show')
    .description('Print receipts')
    .addOption(required('--data <dir>', 'data directory'))
    .option('--last <n>', 'only the last N')
    .action(async (opts) => { await (await import('./commands/receipts.ts')).receiptsShow(opts) })

  program.command('status')
    .description('The mesh as one node sees it')
    .option('--api <url>', 'node API URL', 'http://127.0.0.1:8080')
    .action(async (opts) => { await (await import('./commands/status.ts')).status(opts) })

  program.command('doctor')
    .description('Node version, engines, devices, ports, identity — with the fix for each problem')
    .option('--identity <dir>', 'identity directory to check')
    .action(async (opts) => { await (await import('./commands/doctor.ts')).doctor(opts) })

  return program
}

/** Runs the CLI and returns the exit code (0 ok, 2 misuse or expected failure, 1 bug). */
export async function main (argv: string[]): Promise<number> {
  const program = buildProgram()
  try {
    await program.parseAsync(argv, { from: 'user' })
    return 0
  } catch (err) {
    if (err instanceof CommanderError) {
      if (err.code === 'commander.helpDisplayed' || err.code === 'commander.version' || err.code === 'commander.help') return 0
      process.stderr.write(`shoal: ${err.message.replace(/^error: /, '')}\n`)
      return 2
    }
    if (isExitError(err)) {
      if (err.message !== '') process.stderr.write(`shoal: ${err.message}\n`)
      return err.exitCode
    }
    process.stderr.write(`shoal: unexpected error: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`)
    return 1
  }
}
