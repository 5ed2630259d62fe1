# NixOS module snippet: the nightly prefix-registry mirror (same as prefix-mirror.service
# and prefix-mirror.timer). Import it from configuration.nix and set `prefixreg` to the
# package that provides bin/prefix-mirror (it needs rsync and openssh on PATH).
{ config, pkgs, prefixreg, ... }:

{
  users.users.prefixreg = {
    isSystemUser = true;
    group = "prefixreg";
    home = "/var/lib/prefixreg";
  };
  users.groups.prefixreg = { };

  systemd.services.prefix-mirror = {
    description = "Mirror the prompt-prefix registry to the workers (rsync -a --delete, verified)";
    wants = [ "network-online.target" ];
    after = [ "network-online.target" ];
    path = [ pkgs.rsync pkgs.openssh ];
    environment = {
      PREFIXREG_HOME = "/var/lib/prefixreg/registry";
      # Space-separated [user@]host:path destinations; each must be empty or already a mirror.
      PREFIXREG_MIRROR_TO = "prefixreg@worker-1:/var/lib/prefixreg/mirror prefixreg@worker-2:/var/lib/prefixreg/mirror";
      PREFIXREG_SSH_OPTS = "IdentityFile=/var/lib/prefixreg/.ssh/id_ed25519 UserKnownHostsFile=/var/lib/prefixreg/.ssh/known_hosts StrictHostKeyChecking=yes";
    };
    serviceConfig = {
      Type = "oneshot";
      User = "prefixreg";
      # Exit 0: all verified; 6: a worker failed or refused; 3: integrity failure, nothing sent.
      ExecStart = "${prefixreg}/bin/prefix-mirror";
      TimeoutStartSec = "2h";
      Nice = 10;
      IOSchedulingClass = "idle";
      ProtectSystem = "strict";
      ReadWritePaths = [ "/var/lib/prefixreg/registry" ];
      ProtectHome = true;
      PrivateTmp = true;
      NoNewPrivileges = true;
    };
  };

  systemd.timers.prefix-mirror = {
    description = "Nightly prompt-prefix registry mirror";
    wantedBy = [ "timers.target" ];
    timerConfig = {
      OnCalendar = "*-*-* 03:15:00";
      RandomizedDelaySec = "15m";
      Persistent = true;
    };
  };
}
