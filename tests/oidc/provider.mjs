// An OpenID Connect provider for the sign-in tests: the `oidc-provider` package (pinned in
// package.json, installed by .ci/run with `npm ci`), with its development login and consent
// pages, started by tests/oidc/__init__.py as `node provider.mjs CONFIG.json`. CONFIG names the
// issuer, the port (on 127.0.0.1), the clients, the signing keys (a private JWK set) and the
// accounts: {"alice": {"email": ..., "name": ..., "preferred_username": ..., "groups": [...]}}.
// The login form takes an account's name as its login, and any password. The accounts are read
// from CONFIG at each sign-in, so a test changes someone's groups by rewriting it.
import { readFileSync } from 'node:fs';
import Provider from 'oidc-provider';

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'));

const provider = new Provider(config.issuer, {
  clients: config.clients,
  jwks: config.jwks,
  cookies: { keys: ['telemachus-test-only'] },
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name', 'preferred_username'],
    groups: ['groups'],
  },
  features: { devInteractions: { enabled: true } },
  pkce: { required: () => true },
  async findAccount(ctx, id) {
    const account = JSON.parse(readFileSync(process.argv[2], 'utf8')).accounts[id];
    if (!account) return undefined;
    return { accountId: id, async claims() { return { sub: id, email_verified: true, ...account }; } };
  },
});

provider.listen(config.port, '127.0.0.1', () => {
  console.log(`oidc-provider ${config.issuer} listening on 127.0.0.1:${config.port}`);
});
